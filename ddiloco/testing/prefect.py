"""A real ``prefect server start`` for tests, and pointing this process's Prefect client at it.

Prefect 3 reads its settings once, when ``prefect`` is first imported: setting ``PREFECT_API_URL``
in ``os.environ`` afterwards does not reach the client, which then quietly starts an ephemeral
server of its own (and talks to it instead). So the client is pointed with ``temporary_settings``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ddiloco.testing.net import free_port, wait_for

QUIET = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class PrefectServer:
    """A running server: ``env`` is what a worker or CLI subprocess needs to reach it."""

    api_url: str
    env: dict[str, str]
    home: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def spawn(self, args: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        """A subprocess in its own session (killed with the server), output to ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc


@contextmanager
def prefect_server(
    workdir: Path, *, database_url: str | None = None, command: list[str] | None = None, timeout_s: float = 120.0
) -> Iterator[PrefectServer]:
    """``prefect server start`` on a free port (SQLite under ``workdir``, or ``database_url``), this
    process's client pointed at it; every subprocess spawned through it is killed on exit. ``command``
    (e.g. the compose file's) is run with its ``--host`` and ``--port`` values replaced by 127.0.0.1 and that port."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    port = free_port()
    args = list(command or ["prefect", "server", "start", "--host", "127.0.0.1", "--port", "0", "--analytics-off"])
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        args[args.index(flag) + 1] = value
    home = workdir / "prefect-home"
    api_url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, **QUIET, "PREFECT_HOME": str(home), "PREFECT_API_URL": api_url}
    if database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    server = PrefectServer(api_url=api_url, env=env, home=home)
    assert args[:1] == ["prefect"], args
    server.spawn([sys.executable, "-m", *args], workdir / "prefect-server.log")
    try:
        wait_for(lambda: healthy(f"{api_url}/health"), timeout_s, "the Prefect server")
        with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_HOME: str(home)}):
            yield server
    finally:
        for p in reversed(server.procs):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        kill_by_env("PREFECT_HOME", str(home))  # flow runs a worker started in sessions of their own


def kill_by_env(name: str, value: str) -> list[int]:
    """SIGKILL every process of this user whose environment has ``name=value`` (Linux /proc); their pids."""
    wanted = f"{name}={value}".encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except (OSError, ValueError):
            continue  # gone, or not ours to read
    return killed


def stop_ephemeral_servers() -> None:
    """Stop Prefect's temporary (ephemeral) servers now, not at interpreter exit, when the streams
    their log lines go to may already be closed (pytest closes its capture files first)."""
    if "prefect.server.api.server" not in sys.modules:
        return
    from prefect.server.api.server import SubprocessASGIServer, subprocess_server_logger

    level = subprocess_server_logger.level
    subprocess_server_logger.setLevel(logging.WARNING)  # its "Stopping temporary server" line would follow the summary
    try:
        for server in list(SubprocessASGIServer._instances.values()):
            server.stop()
    finally:
        subprocess_server_logger.setLevel(level)
