"""ddiloco/testing/: test scaffolding that the runtime never imports, and whose S3 part says what to
install when moto is missing."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from ddiloco.testing.net import EchoServer, free_port, poll_until, port_open, wait_for
from ddiloco.testing.progress import longest_gap


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_the_runtime_imports_neither_the_scaffolding_nor_moto():
    out = _python(
        """
        import importlib, pkgutil, sys
        import ddiloco
        runtime = ["ddiloco.cli", "ddiloco.entry", "ddiloco.admin", "ddiloco.inprocess", "ddiloco.demo"]
        for pkg in ("platform", "learner_worker", "synchronizer", "flows"):
            mod = importlib.import_module(f"ddiloco.{pkg}")
            runtime += [m.name for m in pkgutil.walk_packages(mod.__path__, f"ddiloco.{pkg}.")]
        for name in runtime:
            if ".migrations" not in name:
                importlib.import_module(name)
        print(len(runtime), sorted(m for m in sys.modules if m.split(".")[0] == "moto" or m.startswith("ddiloco.testing")))
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    count, leaked = out.stdout.split(" ", 1)
    assert int(count) > 20
    assert leaked.strip() == "[]"


def test_without_moto_the_s3_helper_says_what_to_install():
    out = _python(
        """
        import sys
        sys.modules["moto"] = sys.modules["moto.server"] = None  # as if moto were not installed
        import ddiloco.testing.s3
        """
    )
    assert out.returncode != 0
    assert "ImportError: ddiloco.testing.s3 needs moto's S3 server" in out.stderr
    assert "pip install 'ddiloco[test]'" in out.stderr


def test_longest_gap_skips_excused_windows():
    times = [0.0, 1.0, 5.0, 6.0, 16.0, 17.0]
    assert longest_gap(times) == (10.0, 6.0)
    assert longest_gap(times, excused=[(7.0, 8.0)]) == (4.0, 1.0)
    assert longest_gap([3.0]) == (0.0, 0.0)


def test_poll_until_treats_transient_errors_as_not_yet_and_wait_for_names_what_never_came():
    calls = iter([ConnectionError("restarting"), 0, "ready"])

    def flaky():
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return value

    assert poll_until(flaky, 5, interval_s=0.0, transient=(ConnectionError,)) == "ready"
    with pytest.raises(ConnectionError):
        poll_until(lambda: (_ for _ in ()).throw(ConnectionError()), 5, interval_s=0.0)
    assert poll_until(lambda: 0, 0.0, interval_s=0.0) is None
    with pytest.raises(TimeoutError, match="waiting for the moon"):
        wait_for(lambda: False, 0.0, "the moon", interval_s=0.0)


def test_a_free_port_is_free():
    port = free_port()
    assert 0 < port < 65536
    assert not port_open("127.0.0.1", port, timeout_s=0.5)


def test_a_relay_that_has_said_more_than_its_pipe_holds_still_relays():
    """The relay prints a line per connection; unread, its pipe would fill and block it, cutting every route for good
    (seen in a 30-minute soak: a region's learners stalled for minutes after a partition had healed)."""
    from ddiloco.testing.relay import Relay

    with EchoServer() as echo:
        port = free_port()
        relay = Relay([f"127.0.0.1:{port}=127.0.0.1:{echo.port}@0"])
        try:
            for i in range(1500):  # about 60 bytes a line: well past a 64 KiB pipe
                with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                    c.sendall(b"x")
                    assert c.recv(16) == b"x", i
            wait_for(lambda: len(relay.output) == relay.output.maxlen and "closed" in relay.output[-1], 30, "the relay's lines")
        finally:
            relay.stop()


def test_a_drivers_ledger_sessions_outlast_a_pause_that_ends_a_run_process_session(fresh_postgres_database, tmp_path):
    """The chaos suite's and the soak's driver are not processes under test: a pause of theirs inside a
    transaction must not end it, while the run's processes keep the idle-in-transaction limit."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    from ddiloco.platform.config import build_config
    from ddiloco.platform.runtime import RunContext
    from ddiloco.testing.processes import watcher_context

    cfg = build_config({"name": "watched", "ledger": {"url": fresh_postgres_database, "idle_in_transaction_timeout_s": 0.3},
                        "storage": {"url": f"file://{tmp_path}"}})
    run, driver = RunContext.open(cfg), watcher_context(cfg, "watched")
    try:
        with driver.reading() as s:
            assert s.scalar(text("SHOW idle_in_transaction_session_timeout")) == "0"
            time.sleep(0.8)  # the pause under test, not a wait for anything
            assert s.scalar(text("SELECT 1")) == 1
        # psycopg reports the server's end as IdleInTransactionSessionTimeout or, when it lands mid-read, as an
        # OperationalError ("consuming input failed"): both are what failed the chaos suite's faults in CI.
        with pytest.raises(DBAPIError, match="idle-in-transaction|consuming input"), run.reading() as s:
            assert s.scalar(text("SHOW idle_in_transaction_session_timeout")) == "300ms"
            time.sleep(0.8)
            s.scalar(text("SELECT 1"))
    finally:
        run.engine.dispose()
        driver.engine.dispose()
