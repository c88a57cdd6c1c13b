"""The in-process event loop (ddiloco/inprocess.py): a step's hand-off (upload, heartbeat) waits until the next
learner's step is queued, so a GPU's kernels overlap the host's upload work; nothing may show of it in the run."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import select
from support import tiny_config

from ddiloco.inprocess import run_inprocess
from ddiloco.learner_worker.learner import Learner
from ddiloco.platform.ledger.models import Submission


def test_every_send_is_registered_once_at_the_simulated_time_of_the_step_that_made_it(monkeypatch):
    sends: list[tuple[str, int, float]] = []
    send = Learner.send

    def recorded(self: Learner, p: int, now: float) -> None:
        sends.append((self.id, p, now))
        send(self, p, now)

    monkeypatch.setattr(Learner, "send", recorded)
    # Unequal speeds: the learner whose hand-off waits steps at other times than the one that takes it over.
    region = {"name": "us", "learners": 3, "speeds": [1.0, 0.5, 0.75]}
    cfg = tiny_config(learners={"batch_size": 4, "heartbeat_s": 1.0, "regions": [region]}, fragments={"count": 2})
    run = run_inprocess(cfg, total_tokens=3 * 12 * 4 * 32)
    with run.ctx.reading() as s:
        subs = list(s.scalars(select(Submission).where(Submission.run_id == run.ctx.run_id)))
    registered = sorted((sb.learner_id, sb.fragment, sb.created_at.timestamp()) for sb in subs)
    made = sorted((lid, p, datetime.fromtimestamp(now, timezone.utc).timestamp()) for lid, p, now in sends)
    assert len(made) > 12 and {lid for lid, _, _ in made} == set(run.learners)
    assert registered == made  # the last step's send too, and each at its own step's time, not the next learner's
    assert all(not learner.link.outbox.queued() for learner in run.learners.values())
