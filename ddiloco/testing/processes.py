"""A run's learners and synchronizers as OS processes, started the way the flows start them
(:class:`~ddiloco.flows.launchers.SubprocessLauncher`), each with its fault points armed by the
environment (see :mod:`ddiloco.platform.faults`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import yaml

from ddiloco.entry import ProcessSpec
from ddiloco.flows.launchers import SubprocessLauncher, WarmProcess
from ddiloco.platform.config import RunConfig, secret_env
from ddiloco.platform.faults import ARMED_BY_FILE, arm_file
from ddiloco.platform.runtime import RunContext

FAULT_ENV = ("DDILOCO_FAULTS", "DDILOCO_FAULT_DIR")


def write_config(cfg: RunConfig, path: Path) -> Path:
    """Save ``cfg`` where ``ddiloco … --config`` reads it."""
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def watcher_context(cfg: RunConfig, run_id: str) -> RunContext:
    """The ledger handles of a driver: the test or suite that writes or watches a run, and injects its faults.

    Its sessions go without the run's idle-in-transaction limit: that limit is there so a frozen
    learner or synchronizer releases its row locks, and the driver is not a process under test. On a
    starved machine a pause of the driver between two statements outlasted it (soak checks skipped;
    a chaos fault failed through no fault of the run's); the run's own processes keep it."""
    ledger = cfg.ledger.model_copy(update={"idle_in_transaction_timeout_s": None})
    return RunContext.open(cfg.model_copy(update={"ledger": ledger}), run_id)


def stop_processes(procs: Iterable[subprocess.Popen | WarmProcess], grace_s: float = 30.0) -> None:
    """SIGTERM every process still running (after SIGCONT: a stopped one cannot act on it), then
    SIGKILL whatever is left after ``grace_s``."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


class ProcessCluster:
    """The processes of one run, by name; a process may be stopped at a named fault point, signalled and restarted.

    With ``warm``, learners and synchronizers start as the flows' launcher starts them: forked from the warm fork
    server (:func:`~ddiloco.flows.launchers.warm_up`), so a start or a restart costs a fork, not seconds of imports."""

    def __init__(self, config_path: Path, run_id: str, logdir: Path, env: Mapping[str, str] | None = None,
                 warm: bool = False, secrets: Mapping[str, str] | None = None) -> None:
        """``secrets``: the config's secrets as environment variables (``secret_env``), which the saved config at
        ``config_path`` holds masked: every process gets them, as the flows' launcher gives them."""
        self.launcher = SubprocessLauncher(config_path, run_id, logdir)
        self.config_path, self.run_id, self.logdir, self.warm = config_path, run_id, logdir, warm
        self.env = {k: v for k, v in (os.environ if env is None else env).items() if k not in FAULT_ENV}
        self.env.update(secrets or {})
        self.procs: dict[str, subprocess.Popen | WarmProcess] = {}

    def start(
        self, name: str, process: ProcessSpec, *, faults: str | Sequence[str] = (), env: Mapping[str, str] | None = None,
        wrap: Sequence[str] = (), warm: bool = False,
    ) -> subprocess.Popen | WarmProcess:
        """Start ``process`` as ``name``. ``faults`` is a ``DDILOCO_FAULTS`` spec (``"learner.after_blob:3"``)
        or the points to arm later, one by one, with :meth:`arm`; ``env`` adds to the cluster's environment;
        ``warm`` forks it from the warm fork server (not with ``wrap``)."""
        env = {**self.env, **(env or {})}
        spec = faults if isinstance(faults, str) else ",".join(f"{p}:{ARMED_BY_FILE}" for p in faults)
        if spec:
            env.update(DDILOCO_FAULTS=spec, DDILOCO_FAULT_DIR=str(self.fault_dir(name)))
        self.procs[name] = self.launcher.spawn(name, process, env=env, wrap=wrap, warm=warm).process
        return self.procs[name]

    def learner(self, lid: str, *, faults: str | Sequence[str] = (), env: Mapping[str, str] | None = None,
                wrap: Sequence[str] = ()) -> subprocess.Popen | WarmProcess:
        return self.start(lid, ProcessSpec.learner(lid), faults=faults, env=env, wrap=wrap, warm=self.warm)

    def synchronizer(self, label: str, *, faults: str | Sequence[str] = (), env: Mapping[str, str] | None = None,
                     wrap: Sequence[str] = ()) -> subprocess.Popen | WarmProcess:
        return self.start(label, ProcessSpec.synchronizer(label), faults=faults, env=env, wrap=wrap, warm=self.warm)

    # --- fault points ------------------------------------------------------------------------------

    def fault_dir(self, name: str) -> Path:
        return self.logdir / "faults" / name

    def arm(self, name: str, point: str) -> None:
        """Make ``name`` (started with ``point`` armed by file) stop the next time it reaches ``point``."""
        (self.fault_dir(name) / point).unlink(missing_ok=True)
        trigger = arm_file(self.fault_dir(name), point)
        trigger.parent.mkdir(parents=True, exist_ok=True)
        trigger.write_text("")

    def disarm(self, name: str, point: str) -> None:
        arm_file(self.fault_dir(name), point).unlink(missing_ok=True)

    def fault_reached(self, name: str, point: str) -> bool:
        """``name`` is stopped at ``point`` (it wrote its marker there)."""
        return (self.fault_dir(name) / point).exists()

    # --- signals and logs ----------------------------------------------------------------------------

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait(timeout=10)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)

    def log(self, name: str) -> str:
        path = self.logdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self, grace_s: float = 30.0) -> None:
        stop_processes(self.procs.values(), grace_s)


class ProcessRun(ProcessCluster):
    """A run on a SQLite ledger (or the ``ledger_url`` given) and a file:// store under ``workdir``, its learners and
    synchronizers real processes."""

    def __init__(self, workdir: Path, cfg: RunConfig, warm: bool = False, ledger_url: str | None = None) -> None:
        cfg = cfg.model_copy(
            update={
                "ledger": cfg.ledger.model_copy(update={"url": ledger_url or f"sqlite:///{workdir / 'ledger.db'}"}),
                "storage": cfg.storage.model_copy(update={"url": f"file://{workdir / 'store'}"}),
            }
        )
        super().__init__(write_config(cfg, workdir / "config.yaml"), cfg.name, workdir, warm=warm, secrets=secret_env(cfg))
        self.cfg = cfg
        self.dir = workdir
        self.ctx = watcher_context(cfg, cfg.name)
