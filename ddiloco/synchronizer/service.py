"""The synchronizer service: holds a shard's lease, polls the ledger, merges that shard's fragments, publishes versions.

``Synchronizer.poll_once(now)`` is one pass: snapshot the ledger, decide per fragment, merge. The
process loop, tests and the in-process simulation all call it. Decisions come from ``policy``, the
merge from ``merge.merge_fragment``; this module owns the I/O."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
from tenacity import RetryCallState, Retrying, retry_if_exception_type, retry_if_not_exception_type, wait_exponential

from ddiloco.platform import compact, liveness, metrics
from ddiloco.platform.compression import CompactBase, CompressionError, compact_version, decode_delta_into
from ddiloco.platform.config import ConfigError, codec_ladder, tokens_per_step
from ddiloco.platform.faults import fault_point
from ddiloco.platform.fragments import fragment_views, shard_fragments
from ddiloco.platform.ids import global_key, outer_state_key
from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import FragmentVersion, Submission
from ddiloco.platform.models.weights import load_weights, read_weights
from ddiloco.platform.run_state import Layout, build_layout, read_version, register_run
from ddiloco.platform.runtime import RunContext, to_datetime, to_timestamp
from ddiloco.platform.spans import span
from ddiloco.platform.store import StoreError
from ddiloco.synchronizer import policy as pol
from ddiloco.synchronizer.evaluation import load_params, newest_params
from ddiloco.synchronizer.gc import collect_garbage
from ddiloco.synchronizer.lease import ShardLease, holder_name
from ddiloco.synchronizer.merge import FlatDelta, FlatLayout, GlobalFragment, Member, MergePolicy, MergeWorkspace, merge_fragment
from ddiloco.synchronizer.outer import momentum_from_blob, momentum_to_blob
from ddiloco.synchronizer.validate import Norms, ValidationPolicy, admit, clip, judge_groups, judge_norm, recent_norms

log = logging.getLogger("ddiloco.synchronizer")

FETCH_WORKERS = 8
"""Submission blobs fetched and decoded at once during a merge."""
STATUS_EVERY_S = 1.0
"""How often learner statuses (alive, straggling, dead) are recomputed from heartbeats."""
NORM_HISTORY = 8
"""Recently merged norms an outlier is judged against: short, because norms grow during warm-up."""
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


@dataclass(frozen=True)
class Snapshot:
    """What one pass decides from, read from the ledger at its start."""

    regions: dict[str, str]
    """Region of every registered learner."""
    most_tokens: dict[str, int]
    """The most tokens one inner step of every registered learner trains: its recorded ranks' batches."""
    live: frozenset[str]
    pending: dict[int, list[Submission]]
    """Pending submissions by fragment, fragments in order."""
    latest: dict[int, FragmentVersion]
    quorum: int
    grace_s: float


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
        fc = self.cfg.fragments
        self.cheaper_download_codecs = [c for c in codec_ladder(self.cfg.compression.download_codec, fc.adaptive_min_codec)[1:]
                                        if fc.adaptive and c != "none"]
        """Codecs besides the download codec each version's delta is also published in (adaptive runs)."""
        self.bases: dict[int, tuple[CompactBase, compact.CompactRef]] = {}
        """Each fragment's base of the compact downloads (``compression.download_codec``), as learners hold it, and
        the newest version's compact form (whose base and step blobs the next versions name again)."""
        self.stats = pol.TimingStats()
        self.simulated_time = False
        """In-process runs: a merge takes no simulated time, so the sync-time average stays 0."""
        self.merge_policy = MergePolicy.from_config(self.cfg)
        self.validation = ValidationPolicy.from_config(self.cfg)
        try:  # decode rows and version buffers, reused from merge to merge
            self.workspace = MergeWorkspace(self.cfg.synchronizer.merge_device)
        except ValueError as err:
            raise ConfigError(f"synchronizer.merge_device: {err}") from None
        self.grace_policy = pol.GracePolicy(
            enabled=self.cfg.grace.enabled,
            gamma=self.cfg.grace.gamma,
            overlap_steps=self.cfg.fragments.overlap,
            min_s=self.cfg.grace.min_s,
            max_s=self.cfg.grace.max_s,
        )
        self.liveness = liveness.LivenessPolicy.from_learners_config(self.cfg.learners)
        self.quorum_policy = pol.QuorumPolicy(self.cfg.quorum.min_count, self.cfg.quorum.min_fraction)
        self._registered = False
        self._own: frozenset[int] = frozenset()
        self._bootstrapped = False
        self._last_status = -math.inf
        self._last_gc = -math.inf
        self._detail_passes = 0
        self._poll_started: float | None = None
        self._fetch_pool = ThreadPoolExecutor(max_workers=FETCH_WORKERS, thread_name_prefix="fetch")

    @property
    def held(self) -> tuple[int, int] | None:
        """(shard, fencing token) of the lease this holder has, if any."""
        return self.lease.held

    @property
    def token(self) -> int | None:
        """The fencing token of the lease held (None on standby)."""
        return self.held[1] if self.held else None

    @property
    def shard(self) -> int | None:
        """The shard whose lease is held (None on standby)."""
        return self.held[0] if self.held else None

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
            snap = self._snapshot(now)
            metrics.observe_pass(self.ctx.run_id, self.holder, active=True, pending=sum(len(v) for v in snap.pending.values()))
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
                recorded = runs_q.require_run(s, self.ctx.run_id).config_json
            # Two shard counts in one run would give a fragment two leases: merged twice, or by neither.
            shards = json.loads(recorded).get("synchronizer", {}).get("shards", 1)
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
        if got != self.held:
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
        self.bases.clear()

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
                self._publish(frag.index, 0, {k: v.detach().clone() for k, v in fragment_views(params, frag).items()}, None, now)
        self._bootstrapped = True

    def _write_statuses(self, now: float) -> None:
        """Write every learner's liveness verdict to the ledger (at most every STATUS_EVERY_S; shard 0's holder)."""
        if self.shard != 0 or now - self._last_status < STATUS_EVERY_S:
            return
        self._last_status = now
        with self.ctx.transaction() as s:
            sync_q.update_learner_statuses(s, self.ctx.run_id, to_datetime(now), self.liveness)

    def _snapshot(self, now: float) -> Snapshot:
        """Read learners, pending work and versions; fold the live median step time into the averages."""
        run_id, now_dt = self.ctx.run_id, to_datetime(now)
        with self.ctx.reading() as s:
            rows = runs_q.learners(s, run_id)
            pending = sync_q.pending_submissions(s, run_id, fragments=self._pending_filter())
            latest = runs_q.latest_versions(s, run_id)
        snaps = runs_q.learner_snapshots(rows)
        live = frozenset(liveness.live_ids(liveness.learner_verdicts(snaps, now_dt, self.liveness)))
        step_s = liveness.median_live_step_s(snaps, now_dt, self.liveness)
        if step_s:
            self.stats = replace(self.stats, step_s=step_s)
        by_fragment: dict[int, list[Submission]] = defaultdict(list)
        for sub in pending:
            by_fragment[sub.fragment].append(sub)
        lc, batch = self.cfg.learners, self.cfg.learners.batch_size * self.cfg.inner.grad_accum_steps
        return Snapshot(
            regions={r.id: r.region for r in rows},
            # Per learner the ranks differ (the job's world size, recorded as it registered), within the run's limit.
            most_tokens={r.id: tokens_per_step(self.cfg.model, batch, pol.judged_ranks(r.world_size, lc.max_world_size))
                         for r in rows},
            live=live,
            pending=dict(sorted(by_fragment.items())),
            latest=latest,
            quorum=pol.quorum_size(self.quorum_policy, len(live)),
            grace_s=pol.grace_window(self.stats, self.grace_policy),
        )

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
            self._reject([(sb.id, why) for sb in subs], now)
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
        current = self._fragment_state(fragment, snap.latest)
        with span("sync.fetch"):
            members, rejected = self._fetch(fragment, subs, current.version, snap)
        if not members:
            self._reject(rejected, now)
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
        self._publish(fragment, outcome.version, outcome.params, outcome.momentum, now, merged=merged, rejected=rejected, record=record)
        self.stats = pol.update_stats(
            self.stats,
            self.cfg.grace.ema,
            # From the first pending submission to quorum, as in the simulator (not from the previous
            # publish, which adds the fragment's send period and leaves no grace window when H > tau).
            quorum_s=max(0.0, t_q - min(to_timestamp(sb.created_at) for sb in subs)),
            sync_s=0.0 if self.simulated_time else time.perf_counter() - t0,
        )
        return True, len(rejected)

    def _fragment_state(self, fragment: int, latest: dict[int, FragmentVersion]) -> GlobalFragment:
        """The newest published state of a fragment, from memory or the store."""
        row = latest[fragment]
        cached = self.state.get(fragment)
        if cached is not None and cached.version == row.version:
            return cached
        store = self.ctx.store()
        st = GlobalFragment(row.version, read_version(store, row), momentum_from_blob(store.get(row.state_key, row.state_sha256)))
        self.state[fragment] = st
        self._load_base(fragment, row.compact_json)
        return st

    def _load_base(self, fragment: int, compact_json: str | None) -> None:
        """Take over the base the learners hold from the head's compact form; without a usable one the next
        version starts a new base (learners then download its base blob once)."""
        self.bases.pop(fragment, None)
        if self.cfg.compression.download_codec == "none":
            return
        try:
            ref = compact.CompactRef.parse(compact_json)
            if ref is not None:
                blob = self.ctx.store().get(ref.base_blob.key, ref.base_blob.sha256, ref.base_blob.nbytes)
                self.bases[fragment] = (CompactBase(ref.base, blob), ref)
        except (compact.CompactError, StoreError) as err:
            log.warning("fragment %s: base of the compact downloads unusable (%s): starting a new one", fragment, err)

    def _fetch(
        self, fragment: int, subs: list[Submission], version: int, snap: Snapshot
    ) -> tuple[list[Member], list[tuple[int, str]]]:
        """Read, decode and check the submissions: the members to merge, and (id, reason) for the rest."""
        layout = FlatLayout.of(self.layout.shapes(fragment))
        rows = self.workspace.rows(layout, len(subs))
        with self.ctx.reading() as s:
            history = sync_q.recent_merged_norm_steps(s, self.ctx.run_id, fragment, limit=NORM_HISTORY)
        recent = recent_norms(history, self.validation.period)
        # Only a fragment without a norm history is judged by the optimizer's bound (a pass over its parameters).
        plausible = self._plausible_step_norm(fragment, layout.numel) if len(history) < pol.MIN_NORM_HISTORY else None
        # Blob reads dominate on object stores: fetch and decode them concurrently (order is kept),
        # each straight into its own row of the workspace.
        checked = self._fetch_pool.map(lambda sb, row: self._validate(sb, version, layout, row, recent, snap, plausible), subs, rows)
        members, rejected = [], []
        for sb, got in zip(subs, checked, strict=True):
            if isinstance(got, str):
                rejected.append((sb.id, got))
            else:
                members.append(got)
        members, too_large = judge_groups(members, recent, self.validation, plausible)
        members, clipped = clip(members, recent, self.validation)
        for c in clipped:
            log.info("clipped learner %s's update from %.4g to %.4g (%g x the recent median per step)",
                     c.learner, c.norm, c.bound, self.validation.clip_factor)
        return members, rejected + too_large

    def _plausible_step_norm(self, fragment: int, numel: int) -> float:
        """What one inner step can move this fragment, by the run's optimizer settings."""
        cached = self.state.get(fragment)
        param_norm = math.sqrt(sum(float(t.float().pow(2).sum()) for t in cached.params.values())) if cached else 0.0
        return pol.plausible_step_norm(self.cfg.inner.lr, self.cfg.inner.weight_decay, numel, param_norm)

    def _validate(
        self, sb: Submission, version: int, layout: FlatLayout, row: torch.Tensor, recent: Norms, snap: Snapshot,
        plausible: float | None = None,
    ) -> str | Member:
        """A reason to reject the submission, or the decoded member."""
        why, key = admit(sb, self.ctx.run_id, version, snap.most_tokens.get(sb.learner_id), layout.numel, self.validation)
        if why:
            return why
        try:
            tensors, meta = self.ctx.store(snap.regions[sb.learner_id]).get_with_metadata(key, sb.sha256, sb.nbytes)
            delta = FlatDelta(layout, row, decode_delta_into(tensors, meta, layout.items(), row))
        except StoreError as err:
            return f"blob: {err}"
        except CompressionError as err:
            return f"bad update: {err}"
        except (TypeError, ValueError, OverflowError, RuntimeError, IndexError) as err:
            # Whatever else a hostile blob makes the decoder raise is this blob's fault: it must not stall the fragment.
            return f"bad update: {type(err).__name__}: {' '.join(str(err).split())[:160]}"
        norm = delta.norm
        why = judge_norm(norm, sb.c_steps, recent, self.validation, plausible)
        if why:
            return why
        return Member(sb.id, sb.learner_id, delta, norm, sb.c_steps, sb.c_tokens, sb.base_version)

    def _publish(
        self,
        fragment: int,
        version: int,
        params: dict[str, torch.Tensor],
        momentum: dict[str, torch.Tensor] | None,
        now: float,
        *,
        merged: list[sync_q.MergedIn] | None = None,
        rejected: list[tuple[int, str]] | None = None,
        record: sync_q.MergeRecord | None = None,
    ) -> None:
        """Write the version's blobs, then the one ledger transaction that commits it (fenced by the lease)."""
        with span("sync.publish"):
            store = self.ctx.store()
            # A unique key per attempt: a crashed attempt's blob never collides with the retry.
            attempt = f"-{self.token}-{uuid.uuid4().hex[:8]}.safetensors"
            blob = store.put(global_key(self.ctx.run_id, fragment, version).replace(".safetensors", attempt), params)
            state = store.put(outer_state_key(self.ctx.run_id, fragment, version).replace(".safetensors", attempt),
                              momentum_to_blob(momentum or {}))
            base = self._compact(fragment, version, params, attempt)
            fault_point("sync.before_commit")
            with self.ctx.transaction() as s:
                sync_q.publish_version(
                    s,
                    self.ctx.run_id,
                    fragment,
                    version,
                    blob=sync_q.BlobRef(blob.key, blob.sha256, blob.nbytes),
                    state=sync_q.BlobRef(state.key, state.sha256, state.nbytes),
                    holder=self.holder,
                    token=self.token,
                    now=to_datetime(now),
                    merged=merged or [],
                    rejected=rejected or [],
                    record=record,
                    shard=self.shard,
                    compact_json=None if base is None else base[1].to_json(),
                )
                for sub_id, why in rejected or []:
                    runs_q.record_event(
                        s, self.ctx.run_id, "submission_rejected", self.holder, f"submission {sub_id}: {why}", to_datetime(now)
                    )
            replaced = self.state.get(fragment)
            self.state[fragment] = GlobalFragment(version, params, momentum)
            if base is not None:
                self.bases[fragment] = base
            self.workspace.recycle(replaced)  # this holder reads a version it replaced no more
            if record is not None:
                log.info("fragment %s -> v%s: %s (%s merged, %s rejected)",
                         fragment, version, record.reason, len(merged or []), len(rejected or []))
                metrics.observe_merge(self.ctx.run_id, record.merge_s, [m.staleness for m in merged or []])
            metrics.observe_rejections(self.ctx.run_id, rejected or [])

    def _compact(self, fragment: int, version: int, params: dict[str, torch.Tensor],
                 attempt: str) -> tuple[CompactBase, compact.CompactRef] | None:
        """Write the version's compact form: the delta from the base, and when the base moves on its step and its
        blob. Returns the base after this version and the form (None when downloads are full only)."""
        cc = self.cfg.compression
        if cc.download_codec == "none":
            return None
        with span("sync.compact"):
            held = self.bases.get(fragment)
            codecs = [cc.download_codec, *self.cheaper_download_codecs]
            out = compact_version(held[0] if held else None, version, params, codecs, cc.block_size, cc.download_base_every)
            store, key = self.ctx.store(), global_key(self.ctx.run_id, fragment, version)

            def put(kind: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> compact.Ref:
                info = store.put(key.replace(".safetensors", f"-{kind}{attempt}"), tensors, meta)
                return compact.Ref(info.key, info.sha256, info.nbytes)

            delta = put("delta", *out.deltas[cc.download_codec])
            # Adaptive learners may upload in cheaper codecs than the run's; their downloads can be as cheap.
            cheaper = {c: put(f"delta{c}", *out.deltas[c]) for c in self.cheaper_download_codecs}
            if not out.new_base and held is not None:
                return out.base, replace(held[1], delta=delta, cheaper=cheaper)
            step = put("step", *out.step) if out.step is not None else None
            return out.base, compact.CompactRef(cc.download_codec, version, delta, put("base", out.base.tensors), out.step_from, step,
                                                cheaper)

    def _reject(self, rejected: list[tuple[int, str]], now: float) -> None:
        """Reject submissions outside a merge, each with its reason."""
        metrics.observe_rejections(self.ctx.run_id, rejected)
        with self.ctx.transaction() as s:
            sync_q.reject_submissions(s, self.ctx.run_id, rejected, holder=self.holder, token=self.token, now=to_datetime(now),
                                 shard=self.shard)

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
        """Poll until stopped (or the run is finished), as active or standby."""
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

    def _poll_and_check(self) -> tuple[PollResult, bool]:
        """One poll, then whether the run has finished and this synchronizer must drain it."""
        self._poll_started = time.monotonic()
        try:
            result = self.poll_once(self.ctx.now())
        finally:
            self._poll_started = None
        with self.ctx.reading() as s:
            run = runs_q.get_run(s, self.ctx.run_id)
        return result, run is not None and run.status != "running" and result.role == "active"

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
                        result, finished = self._poll_and_check()
            except ConfigError:
                raise
            except Exception:  # noqa: BLE001 - only reached once stopping: the last failure is logged
                log.exception("poll failed while stopping")
                break
            if result.role != role:
                role = result.role
                log.info("%s is %s", self.holder, role)
            if finished:
                self.poll_once(self.ctx.now(), drain=True)
                break
            stop.wait(self.cfg.synchronizer.poll_s)
