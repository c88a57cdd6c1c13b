"""Small configs and helpers shared by the core tests."""

from __future__ import annotations

from typing import Any

from ddiloco.platform.config import RunConfig, build_config


def tiny_config(**sections: Any) -> RunConfig:
    """A one-layer byte GPT small enough to train in milliseconds per step; sections override."""
    data: dict[str, Any] = {
        "name": "t",
        "model": {"kind": "gpt", "n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32},
        "data": {"max_bytes": 400_000, "val_batches": 2},
        "learners": {"batch_size": 4, "regions": [{"name": "us", "learners": 2}], "heartbeat_s": 1.0},
        "inner": {"lr": 3e-3, "warmup_steps": 3},
        "fragments": {"count": 4},
        "compression": {"codec": "none"},
        "ledger": {"url": "sqlite://"},
        "storage": {"url": "memory://unused"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return build_config(data)


# --- real processes ---------------------------------------------------------------------------

import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import yaml  # noqa: E402

from ddiloco.platform.runtime import RunContext  # noqa: E402


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Poll a condition until it holds (returns its value) or fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


class ProcessRun:
    """A run whose learners and synchronizers are real OS processes, on a file ledger and store."""

    def __init__(self, tmp_path: Path, cfg: RunConfig) -> None:
        self.dir = tmp_path
        cfg = cfg.model_copy(
            update={
                "ledger": cfg.ledger.model_copy(update={"url": f"sqlite:///{tmp_path / 'ledger.db'}"}),
                "storage": cfg.storage.model_copy(update={"url": f"file://{tmp_path / 'store'}"}),
            }
        )
        self.cfg = cfg
        self.config_path = tmp_path / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        self.fault_dir = tmp_path / "faults"
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx = RunContext.open(cfg, cfg.name)

    def _start(self, name: str, args: list[str], faults: str | None) -> subprocess.Popen:
        env = dict(os.environ)
        env.pop("DDILOCO_FAULTS", None)
        if faults:
            env["DDILOCO_FAULTS"] = faults
            env["DDILOCO_FAULT_DIR"] = str(self.fault_dir)
        log = open(self.dir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddiloco", *args, "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )
        self.procs[name] = proc
        return proc

    def synchronizer(self, name: str, faults: str | None = None) -> subprocess.Popen:
        return self._start(name, ["synchronizer", "--holder", name], faults)

    def learner(self, lid: str, faults: str | None = None) -> subprocess.Popen:
        return self._start(lid, ["learner", "--learner", lid], faults)

    def fault_reached(self, name: str) -> bool:
        return (self.fault_dir / name).exists()

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)
