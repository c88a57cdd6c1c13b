"""Deterministic in-process runs: learners and a synchronizer in one process on a simulated clock.

Everything is the real code (ledger queries, store, learner, synchronizer); only time is simulated,
so tests and quality benchmarks are reproducible and need no processes. The simulation's knobs live
here, in the event loop, not in the learner: a learner's step takes ``step_time_s / speed``
simulated seconds, its link's I/O runs on the loop's thread between steps (:func:`sim_step`)
instead of on background threads, and a failure schedule takes learners down and back.

Uploads take no simulated time, unless a learner is given an upload bandwidth (``upload_bps``): then
its link uploads one batch at a time, as the upload thread does, and a batch of ``n`` bytes is
registered ``n / bandwidth`` simulated seconds after it was taken from the queue (meanwhile the
learner trains on and its sends queue and coalesce). Downloads take no time either way."""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ddiloco.learner_worker.dist import Dist
from ddiloco.learner_worker.learner import Learner, StepReport
from ddiloco.learner_worker.link import LearnerLink
from ddiloco.learner_worker.outbox import Outgoing
from ddiloco.learner_worker.uploader import Upload
from ddiloco.platform.config import RunConfig
from ddiloco.platform.ledger import open_ledger
from ddiloco.platform.models import build_model
from ddiloco.platform.runtime import RunContext
from ddiloco.synchronizer.evaluation import evaluate_and_record
from ddiloco.synchronizer.service import Synchronizer


class SimClock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True)
class Outage:
    learner: str
    start_s: float
    end_s: float | None
    """Seconds after the run starts; None: never comes back."""


@dataclass
class LinkFigures:
    """What a learner's upload queue went through in a run (over all its incarnations)."""

    max_oldest_unsent_s: float = 0.0
    """The longest an increment waited in its queue, seen at its steps."""
    queue_s: float = 0.0
    """Sum over its steps of the oldest increment's wait (divide by ``steps`` for the mean)."""
    steps: int = 0
    coalesced: int = 0
    """Sends folded into one already queued."""
    cadence_changes: int = 0
    cadences: dict[str, int] = field(default_factory=dict)
    """Steps spent at each cadence, keyed ``every/codec``."""

    def observe(self, link: LearnerLink, now: float) -> None:
        waited = link.outbox.oldest_unsent_s(now)
        self.max_oldest_unsent_s = max(self.max_oldest_unsent_s, waited)
        self.queue_s += waited
        self.steps += 1
        if link.cadence is not None:
            key = f"{link.cadence.every}/{link.cadence.codec}"
            self.cadences[key] = self.cadences.get(key, 0) + 1


@dataclass
class EvalPoint:
    t_s: float
    tokens: int
    val_loss: float
    val_accuracy: float | None


@dataclass
class InProcessRun:
    ctx: RunContext
    sync: Synchronizer
    learners: dict[str, Learner]
    clock: SimClock
    t0: float
    evals: list[EvalPoint] = field(default_factory=list)
    busy_s: float = 0.0
    down_s: float = 0.0
    bytes_sent: int = 0
    tokens_trained: int = 0
    """Every token a learner stepped on, including work lost when it went down (the ledger only
    knows what was reported before that)."""
    links: dict[str, LinkFigures] = field(default_factory=dict)
    eval_model: torch.nn.Module | None = None
    """Where the global model is evaluated when it is not the synchronizer's own (CPU) model: on the learners' GPU."""

    @property
    def elapsed_s(self) -> float:
        return self.clock.t - self.t0


def in_memory_config(cfg: RunConfig) -> RunConfig:
    """The same run on an in-memory ledger and store (unique per call)."""
    tag = uuid.uuid4().hex[:10]
    return cfg.model_copy(
        update={
            "ledger": cfg.ledger.model_copy(update={"url": "sqlite://"}),
            "storage": cfg.storage.model_copy(update={"url": f"memory://ddiloco-{tag}"}),
        }
    )


def sim_learner(ctx: RunContext, learner_id: str, *, index: int | None = None, num_learners: int | None = None,
                device: torch.device | None = None) -> Learner:
    """A learner of ``ctx``'s run driven by a simulation: its link has no threads (see :func:`sim_step`).

    ``index`` and ``num_learners`` default to the learner's place in the config; ``device`` to the CPU."""
    place, region, _ = ctx.cfg.learners.resolve(learner_id)
    # Transfers are timed on the simulated clock: instantaneous, unless the event loop models their time.
    return Learner(
        ctx.cfg, learner_id, link=LearnerLink(ctx, learner_id, region, elapsed=ctx.now), clock=ctx.now,
        # A simulation trains where it is told, not where learners.device says: by default on the CPU, so its
        # figures are the same on every machine.
        dist=Dist.single(device),
        index=place if index is None else index,
        num_learners=ctx.cfg.learners.count if num_learners is None else num_learners,
    )


def sim_step(learner: Learner, now: float, tamper: Callable[[Outgoing], None] | None = None, *, pump: bool = True) -> StepReport:
    """One simulated step: fetch newer versions, step, upload what was sent and heartbeat, all at ``now``.

    ``tamper`` rewrites this step's queued submissions before they are uploaded (a hostile learner);
    without ``pump`` the sends stay queued (the caller models the upload's time)."""
    report = sim_train(learner, now)
    sim_hand_off(learner, now, tamper, pump=pump)
    return report


def sim_train(learner: Learner, now: float) -> StepReport:
    """The first half of :func:`sim_step`: fetch newer versions and step (on a GPU: queue the step's kernels)."""
    assert learner.link is not None
    learner.link.poll()
    return learner.step(now)


def sim_hand_off(learner: Learner, now: float, tamper: Callable[[Outgoing], None] | None = None, *, pump: bool = True) -> None:
    """The second half: upload what the step sent (its encoded bytes come back to host memory: on a GPU the host
    waits for the step) and heartbeat."""
    assert learner.link is not None
    if tamper is not None:
        for out in learner.link.outbox.queued():
            tamper(out)
    if pump:
        learner.link.uploader.pump()
    learner.heartbeat(now)


def run_inprocess(
    cfg: RunConfig,
    *,
    total_tokens: int,
    step_time_s: float = 1.0,
    outages: list[Outage] | None = None,
    sync_poll_s: float | None = None,
    eval_every_tokens: int | None = None,
    max_steps_per_learner: int | None = None,
    adversaries: Mapping[str, float] | None = None,
    upload_bps: Mapping[str, float] | None = None,
    device: torch.device | None = None,
    on_eval: Callable[[EvalPoint], None] | None = None,
) -> InProcessRun:
    """Train until the learners together have trained ``total_tokens``; returns the run's handles.

    ``device``: where every learner trains and the global model is evaluated (default: the CPU; the learners take
    their turns on one GPU, one step at a time, as the simulated clock orders them).

    ``adversaries``: learner -> k; that learner sends -k times what it learned, with honest counts (an
    attack the outlier check cannot see for small k, see ``merge.clip_factor``). ``upload_bps``: learner ->
    bytes per simulated second of its upload link (a learner not named uploads in no time). ``on_eval``: called with
    each evaluation as it is made (a long run's progress)."""
    cfg = in_memory_config(cfg)
    clock = SimClock()
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=clock)
    # One synchronizer per shard (synchronizer.shards), polled one after the other.
    syncs = [Synchronizer(ctx, holder="sync-inprocess" if k == 0 else f"sync-inprocess-{k}", shard=k)
             for k in range(cfg.synchronizer.shards)]
    sync = syncs[0]
    for each in syncs:
        each.simulated_time = True
        each.poll_once(clock.t)  # lease + version 0
    ids = cfg.learners.learner_ids()
    M = len(ids)
    run = InProcessRun(ctx=ctx, sync=sync, learners={}, clock=clock, t0=clock.t)
    if device is not None and device.type != "cpu":
        run.eval_model = build_model(cfg.model, seed=cfg.seed).to(device)
    speeds = {lid: speed for lid, _, speed in ids}
    index = {lid: i for i, (lid, _, _) in enumerate(ids)}
    outages = sorted(outages or [], key=lambda o: o.start_s)
    # Polling more often than a quarter step changes nothing but the cost of the simulation.
    poll_s = sync_poll_s if sync_poll_s is not None else max(cfg.synchronizer.poll_s, step_time_s / 4)

    def new_learner(lid: str) -> Learner:
        learner = sim_learner(ctx, lid, index=index[lid], num_learners=M, device=device)
        learner.start(clock.t)
        return learner

    for lid in speeds:
        run.learners[lid] = new_learner(lid)
    down: dict[str, float] = {}
    # Event queue of (time, order, kind, learner); kinds: step, sync, down, up, uploaded.
    events: list[tuple[float, int, str, str]] = []
    seq = 0
    bandwidth = dict(upload_bps or {})
    in_flight: dict[str, tuple[LearnerLink, Upload, float]] = {}
    run.links = {lid: LinkFigures() for lid in speeds}

    def push(t: float, kind: str, lid: str = "") -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, lid))
        seq += 1

    def start_upload(lid: str, t: float) -> None:
        """The learner's link takes what is queued; it is registered once its bytes have crossed the link."""
        link = run.learners[lid].link
        up = link.uploader.begin_upload()
        if up is None:
            return
        seconds = sum(sub.nbytes for sub in up.subs) / bandwidth[lid]
        in_flight[lid] = (link, up, seconds)
        push(t + seconds, "uploaded", lid)

    def retire(lid: str) -> None:
        """Fold a learner's link figures into the run's before it is replaced."""
        link = run.learners[lid].link
        run.links[lid].coalesced += link.outbox.coalesced
        run.links[lid].cadence_changes += link.cadence_changes

    for lid in speeds:
        push(clock.t + step_time_s / speeds[lid], "step", lid)
    push(clock.t + poll_s, "sync")
    for o in outages:
        push(run.t0 + o.start_s, "down", o.learner)
        if o.end_s is not None:
            push(run.t0 + o.end_s, "up", o.learner)
    trained = 0
    next_eval = eval_every_tokens or 0
    if eval_every_tokens:
        _record_eval(run, 0, on_eval)
    # A step's hand-off (its upload and heartbeat) waits until the next learner's step is queued, so that on a GPU the
    # host's upload work overlaps that step's kernels instead of leaving the GPU idle: the upload's encoded bytes are
    # the one thing a step makes the host wait for. Nothing another learner's poll or step reads depends on it (they
    # read the versions, which only a synchronizer pass publishes), it runs at its own simulated time, and every
    # other event takes it first: the run is the same, event for event.
    pending: tuple[str, float, Callable[[Outgoing], None] | None] | None = None

    def hand_off() -> None:
        nonlocal pending
        if pending is None:
            return
        (who, at, tamper), pending = pending, None
        now, clock.t = clock.t, at
        sim_hand_off(run.learners[who], at, tamper)
        run.links[who].observe(run.learners[who].link, at)
        clock.t = now

    while events and trained < total_tokens:
        t, _, kind, lid = heapq.heappop(events)
        clock.t = t
        overlaps = kind == "step" and pending is not None and lid != pending[0] and lid not in down and lid not in bandwidth
        if not overlaps:
            hand_off()
        if kind == "sync":
            for each in syncs:
                each.poll_once(t)
            push(t + poll_s, "sync")
        elif kind == "down":
            if lid not in down:
                down[lid] = t
        elif kind == "up":
            if lid in down:
                run.down_s += t - down.pop(lid)
                run.bytes_sent += run.learners[lid].link.uploader.bytes_sent
                retire(lid)
                in_flight.pop(lid, None)  # a transfer of the old incarnation died with it
                run.learners[lid] = new_learner(lid)
                push(t + step_time_s / speeds[lid], "step", lid)
        elif kind == "uploaded":
            flight = in_flight.get(lid)
            if flight is None or flight[0] is not run.learners[lid].link or lid in down:
                continue  # the learner went down while its bytes were on the way
            del in_flight[lid]
            flight[0].uploader.finish_upload(flight[1], flight[2])
            start_upload(lid, t)
        elif kind == "step":
            if lid in down:
                continue  # it was taken down; "up" reschedules it
            learner = run.learners[lid]
            if max_steps_per_learner is not None and learner.step_count >= max_steps_per_learner:
                continue
            k = (adversaries or {}).get(lid)
            tamper = None if k is None else flip(k)
            if lid in bandwidth:
                report = sim_step(learner, t, tamper, pump=False)
                run.links[lid].observe(learner.link, t)
                if lid not in in_flight:
                    start_upload(lid, t)
            else:
                report = sim_train(learner, t)
                hand_off()  # the step before's, now that this one is queued
                pending = (lid, t, tamper)
            if report.waiting:
                push(t + poll_s, "step", lid)  # overlap 0: wait for the merge
                continue
            trained += report.tokens
            run.busy_s += step_time_s / speeds[lid]
            push(t + step_time_s / speeds[lid], "step", lid)
            if eval_every_tokens and trained >= next_eval:
                next_eval += eval_every_tokens
                _record_eval(run, trained, on_eval)
    hand_off()
    for since in down.values():
        run.down_s += clock.t - since
    for lid in run.learners:
        retire(lid)
    # Let the synchronizer merge what is still pending, as a real run's end does.
    for each in syncs:
        each.poll_once(clock.t, drain=True)
    run.bytes_sent += sum(learner.link.uploader.bytes_sent for learner in run.learners.values())
    run.tokens_trained = trained
    if eval_every_tokens:
        _record_eval(run, trained, on_eval)
    return run


def flip(k: float) -> Callable[[Outgoing], None]:
    """A tamper for :func:`sim_step`: the submission carries -k times its outer gradient."""

    def tamper(out: Outgoing) -> None:
        out.parts = [{n: t.mul(-k) for n, t in out.delta().items()}]

    return tamper


def _record_eval(run: InProcessRun, tokens: int, on_eval: Callable[[EvalPoint], None] | None) -> None:
    model = run.eval_model if run.eval_model is not None else run.sync.layout.model
    loss, acc = evaluate_and_record(run.ctx, run.clock.t, cache=run.sync.state, model=model)
    run.evals.append(EvalPoint(run.clock.t - run.t0, tokens, loss, acc))
    if on_eval is not None:
        on_eval(run.evals[-1])
