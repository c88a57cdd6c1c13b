"""Chaos actions on a run's processes, and seeded schedules of them.

Processes are found through the ledger (a learner's host and pid, the lease holder's
``label@host:pid``), so any process on the same host can rehearse failures of a run."""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
from dataclasses import dataclass

from ddiloco.platform.config import ChaosEvent, RunConfig
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import Learner
from ddiloco.platform.runtime import RunContext
from ddiloco.synchronizer.lease import parse_holder

log = logging.getLogger("ddiloco.chaos")

SLOW_PERIOD_S = 0.5
"""Duty-cycle period of a slowed learner (SIGSTOP for part of every period)."""


def seeded_schedule(cfg: RunConfig, seconds: float) -> list[ChaosEvent]:
    """The run's chaos events: the listed ones, or ``random_events`` drawn from the seed."""
    if cfg.chaos.events or cfg.chaos.random_events == 0:
        return sorted(cfg.chaos.events, key=lambda e: e.at_s)
    rng = random.Random(cfg.chaos.seed)
    learners = [lid for lid, _, _ in cfg.learners.learner_ids()]
    events = []
    for _ in range(cfg.chaos.random_events):
        at = rng.uniform(0.1, 0.8) * seconds
        action = rng.choice(["kill_learner", "pause_learner", "slow_learner"])
        events.append(
            ChaosEvent(
                at_s=round(at, 2), action=action, target=rng.choice(learners), duration_s=round(rng.uniform(0.05, 0.15) * seconds, 2)
            )
        )
    return sorted(events, key=lambda e: e.at_s)


@dataclass
class ChaosResult:
    applied: bool
    detail: str
    retry: bool = False
    """The target is not up yet (still starting): try the event again a little later."""


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _learner_pid(ctx: RunContext, learner_id: str) -> int | None:
    with ctx.transaction() as s:
        row = s.get(Learner, (ctx.run_id, learner_id))
    if row is None or row.pid is None or row.host != socket.gethostname():
        return None
    return row.pid


def apply_event(ctx: RunContext, event: ChaosEvent) -> ChaosResult:
    """Carry out one chaos event on this host and record it in the ledger's events."""
    if event.action == "kill_synchronizer":
        with ctx.transaction() as s:
            lease = sync_q.current_lease(s, ctx.run_id)
        parsed = parse_holder(lease.holder) if lease else None
        if parsed is None or parsed[1] != socket.gethostname():
            result = ChaosResult(False, "no active synchronizer on this host")
        else:
            ok = _signal(parsed[2], signal.SIGKILL)
            result = ChaosResult(ok, f"SIGKILL active synchronizer {lease.holder}")
    elif event.action == "restart_learner":
        result = ChaosResult(False, "restart is the supervisor's job")
    else:
        pid = _learner_pid(ctx, event.target or "")
        if pid is None:
            result = ChaosResult(False, f"learner {event.target} has no process on this host", retry=True)
        elif event.action == "kill_learner":
            result = ChaosResult(_signal(pid, signal.SIGKILL), f"SIGKILL learner {event.target} (pid {pid})")
        elif event.action == "pause_learner":
            ok = _signal(pid, signal.SIGSTOP)
            if ok and event.duration_s > 0:
                threading.Timer(event.duration_s, _signal, args=(pid, signal.SIGCONT)).start()
            result = ChaosResult(ok, f"SIGSTOP learner {event.target} for {event.duration_s or 'until resumed'} s")
        elif event.action == "resume_learner":
            result = ChaosResult(_signal(pid, signal.SIGCONT), f"SIGCONT learner {event.target}")
        elif event.action == "slow_learner":
            threading.Thread(target=_slow, args=(pid, event.slowdown, event.duration_s), daemon=True).start()
            result = ChaosResult(True, f"slowing learner {event.target} {event.slowdown:g}x for {event.duration_s} s")
        else:
            result = ChaosResult(False, f"unknown action {event.action}")
    if result.applied:
        with ctx.transaction() as s:
            runs_q.record_event(s, ctx.run_id, "chaos", "chaos", result.detail, ctx.now_dt())
        log.info("chaos: %s", result.detail)
    return result


def _slow(pid: int, slowdown: float, duration_s: float) -> None:
    """Stop the process for (1 - 1/slowdown) of every period, so it runs slowdown times slower."""
    stopped = SLOW_PERIOD_S * (1 - 1 / slowdown)
    end = threading.Event()
    remaining = duration_s if duration_s > 0 else float("inf")
    while remaining > 0 and not end.is_set():
        if not _signal(pid, signal.SIGSTOP):
            return
        end.wait(stopped)
        if not _signal(pid, signal.SIGCONT):
            return
        end.wait(SLOW_PERIOD_S - stopped)
        remaining -= SLOW_PERIOD_S
