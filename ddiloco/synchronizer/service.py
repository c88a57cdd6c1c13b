"""The synchronizer service: the loop that holds a shard's lease, polls the ledger, merges that shard's fragments and
publishes versions.

``Synchronizer.poll_once(now)`` is one pass: snapshot the ledger, decide per fragment, merge. The process loop,
tests and the in-process simulation all call it. Each protocol has its own home and this module only sequences
them: the lease (``lease``), what a pass reads (``snapshot``), decisions (``policy``), reading and judging
submissions (``fetch``, ``validate``), the merge (``merge.merge_fragment``), versions and their publication
(``publish``) and garbage collection (``gc``)."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch
from tenacity import RetryCallState, Retrying, retry_if_exception_type, retry_if_not_exception_type, wait_exponential

from ddiloco.platform import metrics
from ddiloco.platform.config import ConfigError
from ddiloco.platform.faults import fault_point
from ddiloco.platform.fragments import fragment_views, shard_fragments
from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import Submission
from ddiloco.platform.models.weights import load_weights, read_weights
from ddiloco.platform.run_state import Layout, build_layout, register_run
from ddiloco.platform.runtime import RunContext, to_datetime, to_timestamp
from ddiloco.platform.spans import span
from ddiloco.synchronizer import policy as pol
from ddiloco.synchronizer.evaluation import load_params, newest_params
from ddiloco.synchronizer.fetch import Fetcher
from ddiloco.synchronizer.gc import collect_garbage
from ddiloco.synchronizer.lease import ShardLease, holder_name
from ddiloco.synchronizer.merge import GlobalFragment, MergePolicy, MergeWorkspace, merge_fragment
from ddiloco.synchronizer.publish import Publisher
from ddiloco.synchronizer.snapshot import PassPolicies, Snapshot, read_snapshot
from ddiloco.synchronizer.validate import ValidationPolicy

log = logging.getLogger("ddiloco.synchronizer")

STATUS_EVERY_S = 1.0
"""How often learner statuses (alive, straggling, dead) are recomputed from heartbeats."""
POLL_RETRY_MAX_S = 5.0
"""Longest wait between two attempts of a failing poll (ledger or store down)."""
GC_EVERY_S = 5.0
"""How often blobs the retention policy lets go are deleted."""
TAKEOVER_DETAIL_PASSES = 40
"""Passes logged in detail after taking the lease over (time, pending, merges, why the rest waits)."""


@dataclass
class PollResult:
    role: str
    """active or standby"""
    merged: list[int] = field(default_factory=list)
    """Fragments for which a version was published in this pass."""
    waiting: dict[int, str] = field(default_factory=dict)
    """Why each fragment with pending work was not merged."""
    rejected: int = 0


class Synchronizer:
    def __init__(self, ctx: RunContext, holder: str | None = None, *, shard: int | None = None) -> None:
        """``shard``: hold only that shard's lease; None takes whichever shard's lease is free (one at a time)."""
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.holder = holder or holder_name()
        self.layout: Layout = build_layout(ctx)
        shards = self.cfg.synchronizer.shards
        if shard is not None and not 0 <= shard < shards:
            raise ConfigError(f"shard {shard}: the run has {shards} synchronizer shard(s), numbered from 0")
        self.lease = ShardLease(ctx, self.holder, shard)
        self.assignment = shard_fragments([f.nbytes for f in self.layout.fragments], shards)
        """The fragments of every shard (the same in every process of the run)."""
        self.state: dict[int, GlobalFragment] = {}
        """Newest published version of each fragment, as far as this holder knows (a cache of the store)."""
        self.stats = pol.TimingStats()
        self.simulated_time = False
        """In-process runs: a merge takes no simulated time, so the sync-time average stays 0."""
        self.merge_policy = MergePolicy.from_config(self.cfg)
        self.validation = ValidationPolicy.from_config(self.cfg)
        try:  # decode rows and version buffers, reused from merge to merge
            self.workspace = MergeWorkspace(self.cfg.synchronizer.merge_device)
        except ValueError as err:
            raise ConfigError(f"synchronizer.merge_device: {err}") from None
        self.publisher = Publisher(ctx, self.lease, self.state, self.workspace)
        self.fetcher = Fetcher(ctx, self.layout, self.workspace, self.validation, self.state)
        self.policies = PassPolicies.from_config(self.cfg)
        self._registered = False
        self._own: frozenset[int] = frozenset()
        self._bootstrapped = False
        self._last_status = -math.inf
        self._last_gc = -math.inf
        self._detail_passes = 0
        self._poll_started: float | None = None

    @property
    def token(self) -> int | None:
        """The fencing token of the lease held (None on standby)."""
        return self.lease.token

    @property
    def shard(self) -> int | None:
        """The shard whose lease is held (None on standby)."""
        return self.lease.shard

    # --- one pass: snapshot -> decide -> merge ----------------------------------------------------

    def poll_once(self, now: float | None = None, *, drain: bool = False) -> PollResult:
        """Renew the lease, then merge every fragment whose policy says so. ``drain`` merges any pending work."""
        now = self.ctx.now() if now is None else now
        started = time.perf_counter()
        with span("sync.poll_once"):
            self._register()
            if not self._acquire(now):
                metrics.observe_pass(self.ctx.run_id, self.holder, active=False)
                return PollResult(role="standby")
            self._bootstrap(now)
            self._write_statuses(now)
            snap, self.stats = read_snapshot(self.ctx, now, self._pending_filter(), self.policies, self.stats)
            metrics.observe_pass(self.ctx.run_id, self.holder, active=True, pending=sum(len(v) for v in snap.pending.values()),
                                 versions=sum(h.version for h in snap.latest.values()),
                                 newest_at=max((to_timestamp(h.created_at) for h in snap.latest.values()), default=None))
            result = PollResult(role="active")
            try:
                for fragment, subs in snap.pending.items():
                    self._pass_fragment(fragment, subs, snap, now, drain, result)
            except errors_q.LeaseLostError:
                log.warning("%s lost the lease while merging", self.holder)
                self._stand_down()
                return PollResult(role="standby")
            self._maybe_collect_garbage(now)
            if self._detail_passes > 0:
                self._detail_passes -= 1
                log.info("pass %d after takeover: %.2fs, %d pending (%s), merged %s, waiting: %s",
                         TAKEOVER_DETAIL_PASSES - self._detail_passes, time.perf_counter() - started,
                         sum(len(v) for v in snap.pending.values()), {f: len(v) for f, v in snap.pending.items()},
                         result.merged, result.waiting)
            return result

    def _register(self) -> None:
        if not self._registered:
            register_run(self.ctx, self.layout)
            with self.ctx.reading() as s:
                recorded = runs_q.recorded_config(runs_q.require_run(s, self.ctx.run_id))
            # Two shard counts in one run would give a fragment two leases: merged twice, or by neither.
            shards = runs_q.recorded_shards(recorded)
            if shards != self.cfg.synchronizer.shards:
                raise ConfigError(f"synchronizer.shards is {self.cfg.synchronizer.shards}, but run {self.ctx.run_id!r} "
                                  f"was started with {shards}: a run's shards are fixed")
            self._registered = True

    def _acquire(self, now: float) -> bool:
        """Take or renew a shard's lease; a new token means someone else may have published that shard's
        fragments meanwhile, so everything read under the old one is forgotten."""
        got = self.lease.acquire(now)
        if got is None:
            self._stand_down()
            return False
        if got != self.lease.held:
            log.info("%s holds the lease of shard %s (fragments %s) with token %s", self.holder, got[0],
                     ",".join(map(str, self.assignment[got[0]])), got[1])
            self.lease.held = got
            self._own = frozenset(self.assignment[got[0]])
            self.state.clear()
            self._bootstrapped = False
            self._detail_passes = TAKEOVER_DETAIL_PASSES
        return True

    def _stand_down(self) -> None:
        """Forget the lease and everything read under it: the next pass starts from the ledger."""
        self.lease.held = None
        self.state.clear()
        self.publisher.bases.clear()
        metrics.forget_active(self.ctx.run_id)

    def _bootstrap(self, now: float) -> None:
        """Publish version 0 of every fragment missing one, from the seeded initial model or model.init_from (once per lease)."""
        if self._bootstrapped:
            return
        with self.ctx.reading() as s:  # a read: it need not wait for (or hold) the write lock
            have = runs_q.latest_version_numbers(s, self.ctx.run_id)
        if self.cfg.model.init_from and not self._own <= set(have):
            source = f"model.init_from {self.cfg.model.init_from}"
            load_weights(self.layout.model, read_weights(self.cfg.model.init_from, source), source)
        params = dict(self.layout.model.named_parameters())
        for frag in self.layout.fragments:
            if frag.index in self._own and frag.index not in have:
                self.publisher.publish(frag.index, 0, {k: v.detach().clone() for k, v in fragment_views(params, frag).items()}, None, now)
        self._bootstrapped = True

    def _write_statuses(self, now: float) -> None:
        """Write every learner's liveness verdict to the ledger (at most every STATUS_EVERY_S; shard 0's holder)."""
        if self.shard != 0 or now - self._last_status < STATUS_EVERY_S:
            return
        self._last_status = now
        with self.ctx.transaction() as s:
            statuses = sync_q.update_learner_statuses(s, self.ctx.run_id, to_datetime(now), self.policies.liveness)
        metrics.observe_regions(self.ctx.run_id, statuses.counts(), statuses.regions)

    def _pending_filter(self) -> sync_q.FragmentFilter | None:
        """Which pending submissions this shard decides: its fragments; shard 0 also those naming no fragment
        of the run (to reject them). None (all) when the run has one shard."""
        if self.cfg.synchronizer.shards == 1:
            return None
        return sync_q.FragmentFilter(tuple(sorted(self._own)), len(self.layout.fragments) if self.shard == 0 else None)

    def _pass_fragment(self, fragment: int, subs: list[Submission], snap: Snapshot, now: float, drain: bool,
                       result: PollResult) -> None:
        """Decide one fragment with pending work, and merge it if the policy (or ``drain``) says so."""
        if fragment not in snap.latest:
            why = f"fragment {fragment} does not exist (run has {len(self.layout.fragments)})"
            self.publisher.reject([(sb.id, why) for sb in subs], now)
            result.rejected += len(subs)
            return
        entries = [pol.PendingEntry(sb.learner_id, to_timestamp(sb.created_at)) for sb in subs]
        decision = pol.decide_merge(now, entries, snap.live, snap.quorum, snap.grace_s, self.cfg.grace.enabled)
        if not decision.merge and not drain:
            result.waiting[fragment] = decision.reason
            return
        reason = decision.reason if decision.merge else f"drain: {decision.reason}"
        try:
            published, rejected = self._merge(fragment, subs, snap, now, decision, reason)
        except errors_q.VersionConflictError as err:
            log.warning("version conflict on fragment %s: %s", fragment, err)
            self.state.pop(fragment, None)
            return
        result.rejected += rejected
        if published:
            result.merged.append(fragment)

    # --- one merge: fetch -> merge_fragment -> publish --------------------------------------------

    def _merge(
        self, fragment: int, subs: list[Submission], snap: Snapshot, now: float, decision: pol.MergeDecision, reason: str
    ) -> tuple[bool, int]:
        """Merge one fragment's pending submissions; returns (published, submissions rejected)."""
        t0 = time.perf_counter()
        current = self.publisher.current(fragment, snap.latest)
        with span("sync.fetch"):
            members, rejected = self.fetcher.fetch(fragment, subs, current.version, snap.regions, snap.learners)
        if not members:
            self.publisher.reject(rejected, now)
            return False, len(rejected)
        fault_point("sync.mid_merge")
        with span("sync.merge"):
            outcome = merge_fragment(current, members, self.merge_policy, live_learners=len(snap.live), workspace=self.workspace)
        t_q = decision.quorum_reached_at if decision.quorum_reached_at is not None else now
        record = sync_q.MergeRecord(
            quorum=decision.quorum,
            live_learners=len(snap.live),
            grace_window_s=decision.grace_s if math.isfinite(decision.grace_s) else -1.0,
            grace_waited_s=max(0.0, now - t_q),
            merge_s=time.perf_counter() - t0,
            reason=reason,
            detail={**outcome.detail, "rejected": [{"submission": i, "reason": r} for i, r in rejected]},
        )
        merged = [sync_q.MergedIn(m["submission"], m["weight"], m["norm"], m["staleness"]) for m in outcome.detail["members"]]
        self.publisher.publish(fragment, outcome.version, outcome.params, outcome.momentum, now, merged=merged, rejected=rejected,
                               record=record)
        self.stats = pol.update_stats(
            self.stats,
            self.cfg.grace.ema,
            # From the first pending submission to quorum, as in the simulator (not from the previous
            # publish, which adds the fragment's send period and leaves no grace window when H > tau).
            quorum_s=max(0.0, t_q - min(to_timestamp(sb.created_at) for sb in subs)),
            sync_s=0.0 if self.simulated_time else time.perf_counter() - t0,
        )
        return True, len(rejected)

    # --- the global model and retention ---------------------------------------------------------

    def global_model(self) -> torch.nn.Module:
        """The global model assembled from the newest version of every fragment."""
        return load_params(self.layout.model, newest_params(self.ctx, self.state))

    def _maybe_collect_garbage(self, now: float) -> None:
        """Shard 0's holder collects the whole run's garbage: one collector, never two racing."""
        if self.shard != 0 or now - self._last_gc < GC_EVERY_S:
            return
        self._last_gc = now
        with span("sync.gc"):
            collect_garbage(self.ctx)

    # --- process loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, until: float | None = None) -> None:
        """Poll until stopped or the run ends (see :meth:`_poll_and_check`), as active or standby."""
        stop = stop or threading.Event()
        renewer = threading.Thread(target=self.lease.renew_loop, args=(stop, lambda: self._poll_started), name="lease-renewer",
                                   daemon=True)
        renewer.start()
        try:
            self._loop(stop, until)
        finally:
            stop.set()
            renewer.join(timeout=5)
            self.lease.release()

    def _poll_and_check(self) -> tuple[PollResult, str | None]:
        """One poll, then how the run has ended (None while it runs, or while this synchronizer stands by). The active
        synchronizer ends the run itself when its token budget is merged: it runs whoever drives the run (a flow, or
        processes started by hand), and learners and the evaluator stop when they see the run end."""
        self._poll_started = time.monotonic()
        try:
            result = self.poll_once(self.ctx.now())
        finally:
            self._poll_started = None
        if result.role != "active":
            return result, None
        with self.ctx.reading() as s:
            run = runs_q.get_run(s, self.ctx.run_id)
            merged = runs_q.tokens_merged(s, self.ctx.run_id) if run is not None and run.status == runs_q.RUNNING else 0
        if run is None:
            return result, None
        if run.status != runs_q.RUNNING:
            return result, run.status
        why = pol.budget_end(merged, run.token_budget)
        if why is None:
            return result, None
        with self.ctx.transaction() as s:
            if not runs_q.set_run_status(s, self.ctx.run_id, runs_q.FINISHED, self.ctx.now_dt(), detail=f"{why} ({self.holder})"):
                return result, runs_q.require_run(s, self.ctx.run_id).status  # it ended meanwhile (an operator's stop stands)
        log.info("%s: run %s finished: %s", self.holder, self.ctx.run_id, why)
        return result, runs_q.FINISHED

    def _poll_failed(self, retry_state: RetryCallState) -> None:
        err = retry_state.outcome.exception() if retry_state.outcome else None
        log.error("poll failed (attempt %s, retrying): %r", retry_state.attempt_number, err)
        # Whatever this pass held may be stale after the failure: start the next pass from the ledger.
        self._stand_down()

    def _loop(self, stop: threading.Event, until: float | None) -> None:
        role = None
        # A ledger or store outage is waited out with exponential backoff; the run goes on after it.
        # (Each ``for attempt in retrying`` starts a fresh backoff.) A bad config (say an init_from
        # that cannot be read) will not get better by waiting: it stops the synchronizer at once.
        retrying = Retrying(
            retry=retry_if_exception_type(Exception) & retry_if_not_exception_type(ConfigError),
            wait=wait_exponential(multiplier=self.cfg.synchronizer.poll_s, max=POLL_RETRY_MAX_S),
            stop=lambda _state: stop.is_set(),
            sleep=stop.wait,
            before_sleep=self._poll_failed,
            reraise=True,
        )
        while not stop.is_set():
            if until is not None and self.ctx.now() >= until:
                break
            try:
                for attempt in retrying:
                    with attempt:
                        result, ended = self._poll_and_check()
            except ConfigError:
                raise
            except Exception:  # noqa: BLE001 - only reached once stopping: the last failure is logged
                log.exception("poll failed while stopping")
                break
            if result.role != role:
                role = result.role
                log.info("%s is %s", self.holder, role)
            if ended is not None:
                if ended == runs_q.FINISHED:  # what was sent before the end is merged; a stopped run merges nothing more
                    self.poll_once(self.ctx.now(), drain=True)
                break
            stop.wait(self.cfg.synchronizer.poll_s)
