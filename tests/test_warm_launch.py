"""Warm launches: a run's processes forked from a fork server that has imported torch and ddiloco once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from datetime import datetime, timezone

import pytest
from support import tiny_config

from ddiloco.flows.launchers import SubprocessLauncher, WarmProcess
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.testing.processes import write_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm launches fork: Linux only")

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.mark.timeout(300)
def test_a_warm_launch_runs_the_process_main_with_the_launchers_environment_into_its_log(tmp_path):
    # The run is in a ledger only the launcher's environment names: the config file points elsewhere.
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    engine = open_ledger(url)
    with session_factory(engine).begin() as s:
        runs_q.create_run(s, "r", config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=10, now=T0)
        learner_q.register_learner(s, "r", "us-0", "us", T0)
        runs_q.set_run_status(s, "r", "finished", T0.replace(minute=1))
    engine.dispose()
    config = write_config(tiny_config(name="r", ledger={"url": f"sqlite:///{tmp_path / 'elsewhere.db'}"}), tmp_path / "config.yaml")
    launcher = SubprocessLauncher(config, "r", tmp_path / "logs", secrets={"DDILOCO_LEDGER__URL": url})
    # An evaluator ends when its run has ended and nothing is left to evaluate; on the config's ledger it would
    # wait for the run to be registered.
    handle = launcher.start_evaluator()
    try:
        assert isinstance(handle.process, WarmProcess)
        assert handle.process.wait(timeout=240) == 0
    finally:
        launcher.close(10.0)
    log = (tmp_path / "logs" / "evaluator.log").read_text()
    assert "evaluator started for run r" in log and "not in the ledger" not in log, log


@pytest.mark.timeout(300)
def test_a_script_without_a_main_guard_that_launches_warm_runs_once(tmp_path):
    # multiprocessing would run the launching program's main module again in every child first.
    config = write_config(tiny_config(name="r", ledger={"url": f"sqlite:///{tmp_path / 'ledger.db'}"}), tmp_path / "config.yaml")
    marker = tmp_path / "ran"
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from ddiloco.entry import ProcessSpec
        from ddiloco.flows.launchers import SubprocessLauncher
        with open({str(marker)!r}, "a") as f:
            f.write("ran\\n")
        launcher = SubprocessLauncher(Path({str(config)!r}), "r", Path({str(tmp_path / "logs")!r}))
        print("exit", launcher.spawn("bad-id", ProcessSpec.learner("../x"), warm=True).process.wait(timeout=240))
        launcher.close(10.0)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "ran\n"
    # The child ran the learner's main (a bad id: a one-line error) into its log; the script printed only its exit code.
    assert done.stdout.split() == ["exit", "2"]
    assert "learner '../x' is not a valid id" in (tmp_path / "logs" / "bad-id.log").read_text()
