"""A run driven by hand (bring-your-own step 3: learners and synchronizers started as processes, no flow) ends on its
own: at its token budget, or when an operator runs ``ddiloco run stop`` or ``finish``; every process then exits by
itself, with no signal sent to it."""

from __future__ import annotations

import subprocess

import pytest
from support import tiny_config
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.platform.invariants import check_run
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.errors import UnknownRunError
from ddiloco.testing.net import wait_for
from ddiloco.testing.processes import ProcessRun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
EXIT_S = 90.0
"""How long every process of an ended run gets to notice the end and exit by itself (seconds; it takes about one poll)."""


def hand_config(name: str, token_budget: int):
    return tiny_config(
        name=name,
        token_budget=token_budget,
        learners={"regions": [{"name": "us", "learners": 2}], "heartbeat_s": 0.5, "poll_s": 0.2},
        fragments={"count": 2},
        synchronizer={"poll_s": 0.1, "lease_ttl_s": 2.0, "eval_every_s": 1000.0},
    )


def exit_codes(run: ProcessRun) -> dict[str, int | None]:
    """Each process's exit code once it has exited by itself, or None for one still running after EXIT_S."""
    codes = {}
    for name, proc in run.procs.items():
        try:
            codes[name] = proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            codes[name] = None
    return codes


def merged_and_status(run: ProcessRun) -> tuple[int, str, str]:
    with run.ctx.reading() as s:
        row = runs_q.require_run(s, run.run_id)
        ends = [e.detail for e in runs_q.events(s, run.run_id) if e.kind == f"run_{row.status}"]
        return runs_q.tokens_merged(s, run.run_id), row.status, " ".join(ends)


def test_a_run_driven_by_hand_ends_at_its_token_budget(tmp_path):
    budget = 2 * 4 * 32 * 12  # two learners, 128 tokens a step: a dozen steps each
    run = ProcessRun(tmp_path, hand_config("byo", budget), warm=True)
    try:
        # As docs/bring-your-own.md step 3 starts them: a synchronizer, a standby and the learners.
        for name in ("sync-a", "sync-b"):
            run.synchronizer(name)
        for lid in ("us-0", "us-1"):
            run.learner(lid)
        codes = exit_codes(run)
        assert codes == dict.fromkeys(codes, 0), {name: run.log(name)[-2000:] for name, code in codes.items() if code != 0}
        merged, status, why = merged_and_status(run)
        assert status == runs_q.FINISHED and merged >= budget
        # The synchronizer ended it (its final drain may merge a little more after the mark).
        assert why.startswith("token budget reached: ") and f"tokens merged of {budget:,} (sync-" in why
        assert check_run(run.ctx) == []
    finally:
        run.stop_all()


def test_run_stop_ends_a_running_runs_processes(tmp_path):
    run = ProcessRun(tmp_path, hand_config("stopme", 10**12), warm=True)
    cli = CliRunner()
    try:
        run.synchronizer("sync-a")
        run.learner("us-0")
        run.learner("us-1")
        # Until its synchronizer registers it, the run is not in the ledger.
        wait_for(lambda: merged_and_status(run)[0] > 0, 180, "a first merge", transient=(UnknownRunError,))
        stopped = cli.invoke(app, ["run", "stop", "stopme", "--config", str(run.config_path)])
        assert stopped.exit_code == 0, stopped.output
        assert stopped.output.startswith("run stopme stopped at ") and len(stopped.output.splitlines()) == 1
        codes = exit_codes(run)
        assert codes == dict.fromkeys(codes, 0), {name: run.log(name)[-2000:] for name, code in codes.items() if code != 0}
        assert merged_and_status(run)[1:] == (runs_q.STOPPED, "by hand: ddiloco run stop")
        assert check_run(run.ctx) == []
        # An ended run stays as it ended; an unknown run is one line, never a traceback.
        again = cli.invoke(app, ["run", "finish", "stopmeee", "--config", str(run.config_path)])
        assert again.exit_code == 2 and "run 'stopmeee' is not in the ledger" in again.output
        late = cli.invoke(app, ["run", "finish", "stopme", "--config", str(run.config_path)])
        assert late.exit_code == 2 and "already ended as stopped" in late.output and "Traceback" not in late.output
        assert merged_and_status(run)[1] == runs_q.STOPPED
    finally:
        run.stop_all()


class Unstartable:
    """A launcher that cannot start a process (as when the image or the node has gone): every start raises, with a
    credential in its message."""

    closed = False

    def _refuse(self, name: str):  # noqa: ANN202
        raise OSError(f"cannot start {name}: postgresql://ddiloco:pw-planted-3c1e@db.internal/ddiloco refused\ndetails")

    def start_synchronizer(self, label: str):  # noqa: ANN201
        self._refuse(label)

    def start_learner(self, learner_id: str, region: str):  # noqa: ANN201
        self._refuse(learner_id)

    def start_evaluator(self):  # noqa: ANN201
        self._refuse("evaluator")

    def close(self, timeout_s: float) -> None:
        self.closed = True


def test_a_supervisor_that_fails_ends_its_run_as_failed_saying_why(tmp_path):
    """With its processes gone, a run whose training flow failed would read as running for good: it ends as failed,
    with the error in one line and no credential; an end an operator gave first stands."""
    from ddiloco.flows.runner import register, supervise
    from ddiloco.platform.runtime import RunContext

    for run_id, ended_first in (("doomed", None), ("stopped-first", runs_q.STOPPED)):
        cfg = tiny_config(name=run_id, ledger={"url": f"sqlite:///{tmp_path}/{run_id}.db"}, storage={"url": f"file://{tmp_path}/{run_id}"})
        register(cfg, run_id)
        ctx = RunContext.open(cfg, run_id)
        if ended_first:
            with ctx.transaction() as s:
                runs_q.set_run_status(s, run_id, ended_first, ctx.now_dt(), detail="by hand: ddiloco run stop")
        launcher = Unstartable()
        with pytest.raises(OSError, match="cannot start sync-a"):
            supervise(cfg, run_id, launcher)
        assert launcher.closed
        with ctx.reading() as s:
            status = runs_q.require_run(s, run_id).status
            ends = [e.detail for e in runs_q.events(s, run_id) if e.kind in {f"run_{end}" for end in runs_q.RUN_ENDS}]
        if ended_first:
            assert (status, ends) == (ended_first, ["by hand: ddiloco run stop"])
        else:
            assert status == runs_q.FAILED
            assert ends == ["the training flow failed: OSError: cannot start sync-a: "
                            "postgresql://ddiloco:***@db.internal/ddiloco refused"]
