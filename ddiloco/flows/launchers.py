"""How a training run starts its learners and synchronizers: local subprocesses, or Prefect
deployment runs in each region's work pool. The supervisor only sees this narrow port."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver
from pathlib import Path
from typing import Protocol

from ddiloco.entry import ProcessSpec, main
from ddiloco.platform.config import RunConfig
from ddiloco.platform.ids import validate_id

LEARNER_DEPLOYMENT = "ddiloco-learner/learner-{region}"
SYNCHRONIZER_DEPLOYMENT = "ddiloco-synchronizer/synchronizer"
EVALUATOR_DEPLOYMENT = "ddiloco-evaluate/evaluate"
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED", "CANCELLING"}


WARM_PRELOAD = "ddiloco.flows._forkserver_preload"


def warm_up() -> bool:
    """Start the fork server warm launches fork from (it imports torch and ddiloco in the background, once);
    False where processes cannot be forked warm (not Linux): launches then start cold."""
    if not sys.platform.startswith("linux"):
        return False
    multiprocessing.get_context("forkserver").set_forkserver_preload([WARM_PRELOAD])
    forkserver.ensure_running()
    return True


def _run_process(spec: ProcessSpec, config_path: str, run_id: str, log_path: str, env: dict[str, str]) -> None:
    """In a forked child: the process's main, as its ``ddiloco`` command runs it cold, its output appended to ``log_path``."""
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    sys.exit(main(spec, Path(config_path), run_id))


class WarmProcess:
    """A run's process forked from the warm fork server, with the part of ``subprocess.Popen`` launchers use."""

    def __init__(self, spec: ProcessSpec, config_path: Path, run_id: str, log_path: Path, env: Mapping[str, str]) -> None:
        self._process = multiprocessing.get_context("forkserver").Process(
            target=_run_process, args=(spec, str(config_path), run_id, str(log_path), dict(env)), name=log_path.stem
        )
        self._process.start()
        self.pid = self._process.pid
        self.args = spec.argv(config_path, run_id)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode


@dataclass
class Handle:
    name: str
    started_at: float
    process: subprocess.Popen | WarmProcess | None = None
    flow_run_id: str | None = None


class Launcher(Protocol):
    def start_learner(self, learner_id: str, region: str) -> Handle: ...

    def start_synchronizer(self, label: str) -> Handle: ...

    def start_evaluator(self) -> Handle: ...

    def is_running(self, handle: Handle) -> bool: ...

    def stop(self, handle: Handle, *, kill: bool = False) -> None: ...

    def close(self, timeout_s: float) -> None: ...


class SubprocessLauncher:
    """Every process on this machine: the embedded default and ``ddiloco demo``.

    Learners, synchronizers and the evaluator start warm where they can (``warm_up``): forked from a server
    that has imported torch and ddiloco once, so a launch or relaunch costs a fork, not seconds of imports."""

    def __init__(self, config_path: Path, run_id: str, logdir: Path, secrets: Mapping[str, str] | None = None) -> None:
        self.config_path = config_path
        self.run_id = run_id
        self.logdir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        self.handles: list[Handle] = []
        self.env = {**os.environ, **secrets} if secrets else None

    def spawn(
        self, name: str, spec: ProcessSpec, *, env: Mapping[str, str] | None = None, wrap: Sequence[str] = (), warm: bool = False
    ) -> Handle:
        """``spec``'s process for this run, logging to ``<logdir>/<name>.log``: forked from the warm fork server with
        ``warm`` (when there is one and nothing wraps it), else its ``ddiloco`` command; both run the same main.
        ``wrap`` prefixes the command line (``ip netns exec <ns>``), ``env`` replaces the inherited environment."""
        validate_id(name, "process name")  # it names the log file: never a path out of logdir
        env = env if env is not None else self.env
        if warm and not wrap and warm_up():
            log_path = self.logdir / f"{name}.log"
            proc: subprocess.Popen | WarmProcess = WarmProcess(spec, self.config_path, self.run_id, log_path,
                                                                os.environ if env is None else env)
        else:
            log = open(self.logdir / f"{name}.log", "ab")
            proc = subprocess.Popen([*wrap, sys.executable, "-m", "ddiloco", *spec.argv(self.config_path, self.run_id)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        handle = Handle(name=name, started_at=time.time(), process=proc)
        self.handles.append(handle)
        return handle

    def start_learner(self, learner_id: str, region: str) -> Handle:
        return self.spawn(learner_id, ProcessSpec.learner(learner_id), warm=True)

    def start_synchronizer(self, label: str) -> Handle:
        return self.spawn(label, ProcessSpec.synchronizer(label), warm=True)

    def start_evaluator(self) -> Handle:
        return self.spawn("evaluator", ProcessSpec.evaluator(), warm=True)

    def is_running(self, handle: Handle) -> bool:
        return handle.process is not None and handle.process.poll() is None

    def stop(self, handle: Handle, *, kill: bool = False) -> None:
        if self.is_running(handle):
            handle.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)

    def close(self, timeout_s: float) -> None:
        """Ask every process to stop (SIGTERM: learners finish their uploads), then kill stragglers."""
        for h in self.handles:
            self.stop(h)
        deadline = time.monotonic() + timeout_s
        for h in self.handles:
            try:
                h.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h.process.kill()
                h.process.wait(timeout=10)


class DeploymentLauncher:
    """Learners as deployment runs in their region's work pool (``region-<name>``)."""

    def __init__(self, cfg: RunConfig, run_id: str) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.handles: list[Handle] = []

    def _run(self, deployment: str, name: str, parameters: dict) -> Handle:
        from prefect.deployments import run_deployment

        flow_run = run_deployment(
            name=deployment, parameters=parameters, timeout=0, as_subflow=False, flow_run_name=f"{self.run_id}-{name}"
        )
        handle = Handle(name=name, started_at=time.time(), flow_run_id=str(flow_run.id))
        self.handles.append(handle)
        return handle

    def _config_parameter(self) -> dict:
        # The ledger and store URLs come from each pool's job variables (env), not from here.
        return self.cfg.model_dump(mode="json", exclude={"ledger", "storage"})

    def start_learner(self, learner_id: str, region: str) -> Handle:
        return self._run(
            LEARNER_DEPLOYMENT.format(region=region),
            learner_id,
            {"config": self._config_parameter(), "learner_id": learner_id, "run_id": self.run_id},
        )

    def start_synchronizer(self, label: str) -> Handle:
        return self._run(SYNCHRONIZER_DEPLOYMENT, label, {"config": self._config_parameter(), "run_id": self.run_id, "label": label})

    def start_evaluator(self) -> Handle:
        return self._run(EVALUATOR_DEPLOYMENT, "evaluator", {"config": self._config_parameter(), "run_id": self.run_id, "follow": True})

    def state(self, handle: Handle) -> str | None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            run = client.read_flow_run(handle.flow_run_id)
        return run.state.type.value if run.state else None

    def is_running(self, handle: Handle) -> bool:
        return self.state(handle) not in FINAL_STATES

    def stop(self, handle: Handle, *, kill: bool = False) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(handle.flow_run_id, Cancelling(), force=True)

    def close(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(self.is_running(h) for h in self.handles):
            time.sleep(1.0)
        for h in self.handles:
            if self.is_running(h):
                self.stop(h)
