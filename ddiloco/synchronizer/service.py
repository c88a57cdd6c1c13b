"""The synchronizer service: holds the lease, polls the ledger, merges fragments, publishes versions.

``Synchronizer.poll_once(now)`` is one pass; the process loop, tests and the in-process
simulation all call it. Decisions come from ``policy``; this module owns the I/O."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential

from ddiloco.platform import liveness
from ddiloco.platform.compression import CompressionError, decode_delta
from ddiloco.platform.data import build_dataset
from ddiloco.platform.faults import fault_point
from ddiloco.platform.ids import global_key, outer_state_key
from ddiloco.platform.ledger import queries as q
from ddiloco.platform.ledger.models import Submission
from ddiloco.platform.models import evaluate
from ddiloco.platform.run_state import Layout, build_layout, read_version, register_run
from ddiloco.platform.runtime import RunContext, to_datetime, to_timestamp
from ddiloco.platform.store import StoreError
from ddiloco.synchronizer import policy as pol
from ddiloco.synchronizer.merge import flatten, merge_vectors, unflatten
from ddiloco.synchronizer.outer import momentum_from_blob, momentum_to_blob, outer_step

log = logging.getLogger("ddiloco.synchronizer")

FETCH_WORKERS = 8
"""Submission blobs fetched and decoded at once during a merge."""
STATUS_EVERY_S = 1.0
"""How often learner statuses (alive, straggling, dead) are recomputed from heartbeats."""
NORM_HISTORY = 8
"""Recently merged norms an outlier is judged against: short, because norms grow during warm-up."""
POLL_RETRY_MAX_S = 5.0
"""Longest wait between two attempts of a failing poll (ledger or store down)."""


@dataclass
class FragmentState:
    version: int
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor] | None
    published_at: float


@dataclass
class PollResult:
    role: str
    """active or standby"""
    merged: list[int] = field(default_factory=list)
    """Fragments for which a version was published in this pass."""
    waiting: dict[int, str] = field(default_factory=dict)
    rejected: int = 0


def holder_name(label: str = "sync") -> str:
    """``label@host:pid``: unique per process, and tells a supervisor where the holder runs."""
    return f"{label}@{socket.gethostname()}:{os.getpid()}"


def parse_holder(holder: str) -> tuple[str, str, int] | None:
    """(label, host, pid) of a holder name made by holder_name, else None."""
    label, at, where = holder.rpartition("@")
    host, colon, pid = where.rpartition(":")
    if not at or not colon or not pid.isdigit():
        return None
    return label, host, int(pid)


class Synchronizer:
    def __init__(self, ctx: RunContext, holder: str | None = None, *, evaluate_every_s: float | None = None) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.holder = holder or holder_name()
        self.token: int | None = None
        self.layout: Layout = build_layout(ctx)
        self.state: dict[int, FragmentState] = {}
        self.stats = pol.TimingStats()
        self.eval_every_s = self.cfg.synchronizer.eval_every_s if evaluate_every_s is None else evaluate_every_s
        self._last_eval: float | None = None
        self._registered = False
        self._bootstrapped = False
        self._last_status = -math.inf
        self._poll_started: float | None = None
        self._fetch_pool = ThreadPoolExecutor(max_workers=FETCH_WORKERS, thread_name_prefix="fetch")
        self._last_gc: float = -math.inf
        self.simulated_time = False
        """In-process runs: a merge takes no simulated time, so the sync-time average stays 0."""
        self._dataset = None
        self._plain_mean = {
            f.index
            for f in self.layout.fragments
            if any(tag in name for name in f.names for tag in self.cfg.merge.plain_mean_fragments)
        }
        self.grace_policy = pol.GracePolicy(
            enabled=self.cfg.grace.enabled,
            gamma=self.cfg.grace.gamma,
            overlap_steps=self.cfg.fragments.overlap,
            min_s=self.cfg.grace.min_s,
            max_s=self.cfg.grace.max_s,
        )
        self.liveness = liveness.LivenessPolicy.from_learners_config(self.cfg.learners)
        self.quorum_policy = pol.QuorumPolicy(self.cfg.quorum.min_count, self.cfg.quorum.min_fraction)

    # --- lease and bootstrap ---------------------------------------------------------------------

    def _acquire(self, now: float) -> bool:
        with self.ctx.transaction() as s:
            token = q.acquire_lease(s, self.ctx.run_id, self.holder, self.cfg.synchronizer.lease_ttl_s, to_datetime(now))
        if token is None:
            if self.token is not None:
                log.warning("%s lost the lease", self.holder)
            self.token = None
            self.state.clear()
            return False
        if token != self.token:
            log.info("%s holds the lease with token %s", self.holder, token)
            self.token = token
            self.state.clear()
            self._bootstrapped = False  # someone else may have published since we last held it
        return True

    def _bootstrap(self, now: float) -> None:
        """Publish version 0 of every fragment from the seeded initial model (once per run)."""
        with self.ctx.transaction() as s:
            have = q.latest_version_numbers(s, self.ctx.run_id)
        params = dict(self.layout.model.named_parameters())
        store = self.ctx.store()
        for frag in self.layout.fragments:
            if frag.index in have:
                continue
            tensors = {n: params[n].detach().clone() for n in frag.names}
            self._publish(frag.index, 0, tensors, None, now)

    def _publish(
        self,
        fragment: int,
        version: int,
        params: dict[str, torch.Tensor],
        momentum: dict[str, torch.Tensor] | None,
        now: float,
        *,
        merged: list[q.MergedIn] | None = None,
        rejected: list[tuple[int, str]] | None = None,
        record: q.MergeRecord | None = None,
    ) -> None:
        store = self.ctx.store()
        # A unique key per attempt: a crashed attempt's blob never collides with the retry.
        attempt = f"{self.token}-{uuid.uuid4().hex[:8]}"
        blob = store.put(global_key(self.ctx.run_id, fragment, version).replace(".safetensors", f"-{attempt}.safetensors"), params)
        state = store.put(
            outer_state_key(self.ctx.run_id, fragment, version).replace(".safetensors", f"-{attempt}.safetensors"),
            momentum_to_blob(momentum or {}),
        )
        fault_point("sync.before_commit")
        with self.ctx.transaction() as s:
            q.publish_version(
                s,
                self.ctx.run_id,
                fragment,
                version,
                blob=q.BlobRef(blob.key, blob.sha256, blob.nbytes),
                state=q.BlobRef(state.key, state.sha256, state.nbytes),
                holder=self.holder,
                token=self.token,
                now=to_datetime(now),
                merged=merged or [],
                rejected=rejected or [],
                record=record,
            )
        self.state[fragment] = FragmentState(version, params, momentum, now)
        if record is not None:
            log.info("fragment %s -> v%s: %s (%s merged, %s rejected)", fragment, version, record.reason, len(merged or []), len(rejected or []))

    def _fragment_state(self, fragment: int, latest: dict[int, object]) -> FragmentState:
        """The newest published state of a fragment, from memory or the store."""
        row = latest[fragment]
        cached = self.state.get(fragment)
        if cached is not None and cached.version == row.version:
            return cached
        store = self.ctx.store()
        params = read_version(store, row)
        momentum = momentum_from_blob(store.get(row.state_key, row.state_sha256))
        st = FragmentState(row.version, params, momentum, to_timestamp(row.created_at))
        self.state[fragment] = st
        return st

    # --- one pass -------------------------------------------------------------------------------

    def poll_once(self, now: float | None = None, *, drain: bool = False) -> PollResult:
        """Renew the lease, then merge every fragment whose policy says so. ``drain`` merges any pending work."""
        now = self.ctx.now() if now is None else now
        if not self._registered:
            register_run(self.ctx, self.layout)
            self._registered = True
        if not self._acquire(now):
            return PollResult(role="standby")
        run_id = self.ctx.run_id
        if not self._bootstrapped:
            with self.ctx.transaction() as s:
                have_versions = q.latest_version_numbers(s, run_id)
            if len(have_versions) < len(self.layout.fragments):
                self._bootstrap(now)
            self._bootstrapped = True
        result = PollResult(role="active")
        now_dt = to_datetime(now)
        if now - self._last_status >= STATUS_EVERY_S:
            self._last_status = now
            with self.ctx.transaction() as s:
                q.update_learner_statuses(s, run_id, now_dt, self.liveness)
        with self.ctx.reading() as s:
            rows = q.learners(s, run_id)
            pending = q.pending_submissions(s, run_id)
            latest = q.latest_versions(s, run_id)
        regions = {r.id: r.region for r in rows}
        snaps = q.learner_snapshots(rows)
        live = liveness.live_ids(liveness.learner_verdicts(snaps, now_dt, self.liveness))
        step_s = liveness.median_live_step_s(snaps, now_dt, self.liveness) or None
        if step_s is not None:
            self.stats = pol.TimingStats(step_s=step_s, quorum_s=self.stats.quorum_s, sync_s=self.stats.sync_s)
        by_fragment: dict[int, list[Submission]] = defaultdict(list)
        for sub in pending:
            by_fragment[sub.fragment].append(sub)
        k = pol.quorum_size(self.quorum_policy, len(live))
        grace_s = pol.grace_window(self.stats, self.grace_policy)
        for fragment, subs in sorted(by_fragment.items()):
            if fragment not in latest:
                self._reject(subs, f"fragment {fragment} does not exist (run has {len(self.layout.fragments)})", now)
                result.rejected += len(subs)
                continue
            entries = [pol.PendingEntry(sb.learner_id, to_timestamp(sb.created_at)) for sb in subs]
            decision = pol.decide_merge(now, entries, live, k, grace_s, self.cfg.grace.enabled)
            if not decision.merge and not drain:
                result.waiting[fragment] = decision.reason
                continue
            reason = decision.reason if decision.merge else f"drain: {decision.reason}"
            try:
                published, n_rejected = self._merge(fragment, subs, latest, now, decision, reason, len(live), regions)
            except q.LeaseLostError:
                log.warning("%s lost the lease while merging fragment %s", self.holder, fragment)
                self.token = None
                self.state.clear()
                return PollResult(role="standby")
            except q.VersionConflictError as err:
                log.warning("version conflict on fragment %s: %s", fragment, err)
                self.state.pop(fragment, None)
                continue
            result.rejected += n_rejected
            if published:
                result.merged.append(fragment)
        self._maybe_evaluate(now)
        self._maybe_collect_garbage(now)
        return result

    def _reject(self, subs: list[Submission], reason: str, now: float) -> None:
        with self.ctx.transaction() as s:
            q.reject_submissions(
                s, self.ctx.run_id, [(sb.id, reason) for sb in subs], holder=self.holder, token=self.token, now=to_datetime(now)
            )

    def _merge(
        self,
        fragment: int,
        subs: list[Submission],
        latest: dict,
        now: float,
        decision: pol.MergeDecision,
        reason: str,
        live: int,
        regions: dict[str, str],
    ) -> tuple[bool, int]:
        t0 = time.perf_counter()
        cur = self._fragment_state(fragment, latest)
        names = list(self.layout.fragments[fragment].names)
        shapes = self.layout.shapes(fragment)
        mcfg = self.cfg.merge
        with self.ctx.reading() as s:
            recent = q.recent_merged_norms(s, self.ctx.run_id, fragment, limit=NORM_HISTORY, per_step=True)
        rejected: list[tuple[int, str]] = []
        # A learner's submissions are increments (each carries what it learned since its previous
        # send or receipt), so several from one learner add up to that learner's outer gradient.
        per_learner: dict[str, list[tuple[Submission, torch.Tensor, float]]] = defaultdict(list)
        # Blob reads dominate on object stores: fetch and decode them concurrently (order is kept).
        checked = self._fetch_pool.map(lambda sb: self._validate(sb, cur.version, names, shapes, recent, regions), subs)
        for sb, why in zip(subs, checked):
            if isinstance(why, str):
                rejected.append((sb.id, why))
            else:
                per_learner[sb.learner_id].append((sb, why[0], why[1]))
        if not per_learner:
            with self.ctx.transaction() as s:
                q.reject_submissions(s, self.ctx.run_id, rejected, holder=self.holder, token=self.token, now=to_datetime(now))
            return False, len(rejected)
        vectors, weights = [], []
        learner_weight: dict[str, float] = {}
        for lid, items in per_learner.items():
            vectors.append(torch.stack([v for _, v, _ in items]).sum(0) if len(items) > 1 else items[0][1])
            c_steps = sum(sb.c_steps for sb, _, _ in items)
            c_tokens = sum(sb.c_tokens for sb, _, _ in items)
            learner_weight[lid] = pol.token_weight(c_tokens, c_steps, mcfg.weighting)
            weights.append(learner_weight[lid])
        accepted = [(sb, norm, learner_weight[sb.learner_id]) for items in per_learner.values() for sb, _, norm in items]
        fault_point("sync.mid_merge")
        method = "mean" if fragment in self._plain_mean else mcfg.method
        merged_vec = merge_vectors(vectors, weights, method)
        scale = pol.participation_scale(len(vectors), live) if mcfg.participation_scaling else 1.0
        if scale != 1.0:
            merged_vec = merged_vec * scale
        outer_grad = unflatten(merged_vec, cur.params, names)
        new_params, new_momentum = outer_step(
            cur.params, outer_grad, cur.momentum, lr=self.cfg.outer.lr, beta=self.cfg.outer.momentum, nesterov=self.cfg.outer.nesterov
        )
        merge_s = time.perf_counter() - t0
        merged = [q.MergedIn(sb.id, w, norm, cur.version - sb.base_version) for sb, norm, w in accepted]
        t_q = decision.quorum_reached_at if decision.quorum_reached_at is not None else now
        record = q.MergeRecord(
            quorum=decision.quorum,
            live_learners=live,
            grace_window_s=decision.grace_s if math.isfinite(decision.grace_s) else -1.0,
            grace_waited_s=max(0.0, now - t_q),
            merge_s=merge_s,
            reason=reason,
            detail={
                "method": method,
                "participation_scale": scale,
                "base_version": cur.version,
                "learners": len(vectors),
                "members": [
                    {"submission": sb.id, "learner": sb.learner_id, "weight": w, "norm": norm, "staleness": cur.version - sb.base_version}
                    for sb, norm, w in accepted
                ],
                "rejected": [{"submission": i, "reason": r} for i, r in rejected],
            },
        )
        self._publish(
            fragment, cur.version + 1, new_params, new_momentum, now, merged=merged, rejected=rejected, record=record
        )
        if rejected:
            with self.ctx.transaction() as s:
                for sub_id, why in rejected:
                    q.record_event(s, self.ctx.run_id, "submission_rejected", self.holder, f"submission {sub_id}: {why}", to_datetime(now))
        self.stats = pol.update_stats(
            self.stats,
            self.cfg.grace.ema,
            # From the first pending submission to quorum, as in the simulator (not from the previous
            # publish, which adds the fragment's send period and leaves no grace window when H > tau).
            quorum_s=max(0.0, t_q - min(to_timestamp(sb.created_at) for sb in subs)),
            sync_s=0.0 if self.simulated_time else time.perf_counter() - t0,
        )
        return True, len(rejected)

    def _validate(
        self,
        sb: Submission,
        current_version: int,
        names: list[str],
        shapes: dict[str, tuple[int, ...]],
        recent: list[float],
        regions: dict[str, str],
    ) -> str | tuple[torch.Tensor, float]:
        """A reason to reject the submission, or its flattened outer gradient and norm."""
        if sb.learner_id not in regions:
            return f"unknown learner {sb.learner_id!r}"
        why = pol.check_counts(sb.c_steps, sb.c_tokens) or pol.check_staleness(
            current_version, sb.base_version, self.cfg.merge.max_staleness
        )
        if why:
            return why
        try:
            tensors, meta = self.ctx.store(regions.get(sb.learner_id)).get_with_metadata(sb.blob_key, sb.sha256)
            delta = decode_delta(tensors, meta, expected=shapes)
        except StoreError as err:
            return f"blob: {err}"
        except CompressionError as err:
            return f"bad update: {err}"
        vector = flatten(delta, names)
        norm = float(torch.linalg.vector_norm(vector))
        # Judged per inner step: increments of one fragment cover different numbers of steps (the
        # first send of fragment p comes after p steps, the next ones after H).
        why = pol.check_finite(norm) or pol.check_norm(norm / max(1, sb.c_steps), recent, self.cfg.merge.norm_outlier_factor)
        if why:
            return why
        return vector, norm

    # --- evaluation and retention ----------------------------------------------------------------

    def global_model(self) -> torch.nn.Module:
        """The global model assembled from the newest version of every fragment."""
        with self.ctx.transaction() as s:
            latest = q.latest_versions(s, self.ctx.run_id)
        model = self.layout.model
        params = dict(model.named_parameters())
        with torch.no_grad():
            for fragment in latest:
                st = self._fragment_state(fragment, latest)
                for n, t in st.params.items():
                    params[n].copy_(t)
        return model

    def evaluate_now(self, now: float) -> tuple[float, float | None]:
        if self._dataset is None:
            self._dataset = build_dataset(self.cfg.data, self.cfg.model)
        batches = self._dataset.val_batches(self.cfg.learners.batch_size)
        loss, acc = evaluate(self.global_model(), batches)
        with self.ctx.transaction() as s:
            acct = q.token_accounting(s, self.ctx.run_id)
            versions = sum(q.latest_version_numbers(s, self.ctx.run_id).values())
            q.record_evaluation(
                s, self.ctx.run_id, now=to_datetime(now), tokens=acct.merged, versions_total=versions, val_loss=loss, val_accuracy=acc
            )
        return loss, acc

    def _maybe_evaluate(self, now: float) -> None:
        if self.eval_every_s <= 0:
            return
        if self._last_eval is None or now - self._last_eval >= self.eval_every_s:
            self._last_eval = now
            self.evaluate_now(now)

    def _maybe_collect_garbage(self, now: float, every_s: float = 5.0) -> None:
        if now - self._last_gc < every_s:
            return
        self._last_gc = now
        collect_garbage(self.ctx, regions=None)

    # --- process loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, until: float | None = None) -> None:
        """Poll until stopped (or the run is finished), as active or standby."""
        stop = stop or threading.Event()
        renewer = threading.Thread(target=self._renew_loop, args=(stop,), name="lease-renewer", daemon=True)
        renewer.start()
        try:
            self._loop(stop, until)
        finally:
            stop.set()
            renewer.join(timeout=5)
            if self.token is not None:
                # Hand over at once instead of making the standby wait for the lease to expire.
                with self.ctx.transaction() as s:
                    q.release_lease(s, self.ctx.run_id, self.holder, self.token, to_datetime(self.ctx.now()))
                self.token = None

    def _renew_loop(self, stop: threading.Event) -> None:
        """Keep the lease alive while a long merge or evaluation runs on the main thread."""
        ttl = self.cfg.synchronizer.lease_ttl_s
        while not stop.wait(ttl / 3):
            token = self.token
            if token is None:
                continue
            if self._poll_started is not None and time.monotonic() - self._poll_started > self.cfg.synchronizer.max_poll_s:
                # A pass stuck this long is a hung synchronizer: let the lease lapse so a standby takes over.
                log.error("%s: a poll has run for over %.0fs; no longer renewing the lease", self.holder, self.cfg.synchronizer.max_poll_s)
                continue
            try:
                with self.ctx.transaction() as s:
                    renewed = q.renew_lease(s, self.ctx.run_id, self.holder, token, ttl, to_datetime(self.ctx.now()))
                    fault_point("sync.renew_lease")
                if not renewed:
                    log.warning("%s could not renew its lease (token %s)", self.holder, token)
            except Exception:  # noqa: BLE001 - the ledger may be restarting; the fence keeps writes safe
                log.exception("lease renewal failed")

    def _poll_and_check(self) -> tuple[PollResult, bool]:
        """One poll, then whether the run has finished and this synchronizer must drain it."""
        self._poll_started = time.monotonic()
        try:
            result = self.poll_once(self.ctx.now())
        finally:
            self._poll_started = None
        with self.ctx.reading() as s:
            run = q.get_run(s, self.ctx.run_id)
        return result, run is not None and run.status != "running" and result.role == "active"

    def _poll_failed(self, retry_state: RetryCallState) -> None:
        err = retry_state.outcome.exception() if retry_state.outcome else None
        log.error("poll failed (attempt %s, retrying): %r", retry_state.attempt_number, err)
        # Whatever this pass held may be stale after the failure: start the next pass from the ledger.
        self.token = None
        self.state.clear()

    def _loop(self, stop: threading.Event, until: float | None) -> None:
        role = None
        # A ledger or store outage is waited out with exponential backoff; the run goes on after it.
        # (Each ``for attempt in retrying`` starts a fresh backoff.)
        retrying = Retrying(
            retry=retry_if_exception_type(Exception),
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
                        result, finished = self._poll_and_check()
            except Exception:  # noqa: BLE001 - only reached once stopping: the last failure is logged
                log.exception("poll failed while stopping")
                break
            if result.role != role:
                role = result.role
                log.info("%s is %s", self.holder, role)
            if finished:
                self.poll_once(self.ctx.now(), drain=True)
                self.evaluate_now(self.ctx.now())
                break
            stop.wait(self.cfg.synchronizer.poll_s)


def collect_garbage(ctx: RunContext, regions: dict[str, str] | None = None) -> tuple[int, int]:
    """Delete blobs the retention policy lets go; returns (versions, submissions) deleted."""
    rcfg = ctx.cfg.synchronizer.retention
    with ctx.transaction() as s:
        versions = q.versions_for_gc(s, ctx.run_id, rcfg.keep_last, rcfg.checkpoint_every)
        subs = [] if rcfg.keep_submission_blobs else q.submissions_for_gc(s, ctx.run_id)
        owner = {l.id: l.region for l in q.learners(s, ctx.run_id)}
    store = ctx.store()
    for v in versions:
        store.delete(v.blob_key)
        store.delete(v.state_key)
    for sb in subs:
        ctx.store(owner.get(sb.learner_id)).delete(sb.blob_key)
    with ctx.transaction() as s:
        q.mark_blobs_deleted(s, [s.merge(v) for v in versions], [s.merge(sb) for sb in subs])
    return len(versions), len(subs)
