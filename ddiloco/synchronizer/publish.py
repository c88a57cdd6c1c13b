"""A holder's versions: the newest one of a fragment (from memory, else the store), and publishing the next: its
blobs (parameters, outer state, and its compact form for the learners' downloads), then the one ledger transaction
that commits it, fenced by the lease's token; rejections outside a merge are fenced the same way. Blob first, row
second: a crash between them leaves an orphan blob, never a row naming a missing one."""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace

import torch

from ddiloco.platform import compact, metrics
from ddiloco.platform.compression import CompactBase, compact_version
from ddiloco.platform.config import codec_ladder
from ddiloco.platform.faults import fault_point
from ddiloco.platform.ids import global_key, outer_state_key
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import FragmentVersion
from ddiloco.platform.run_state import read_version
from ddiloco.platform.runtime import RunContext, to_datetime
from ddiloco.platform.spans import span
from ddiloco.platform.store import StoreError
from ddiloco.synchronizer.lease import ShardLease
from ddiloco.synchronizer.merge import GlobalFragment, MergeWorkspace
from ddiloco.synchronizer.outer import momentum_from_blob, momentum_to_blob

log = logging.getLogger("ddiloco.synchronizer")


class Publisher:
    """Reads the newest version of a fragment and writes the next, and rejections; keeps ``state`` (the newest
    version of each fragment, the service's cache) and each fragment's base of the compact downloads current."""

    def __init__(self, ctx: RunContext, lease: ShardLease, state: dict[int, GlobalFragment], workspace: MergeWorkspace) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.lease = lease
        self.state = state
        self.workspace = workspace
        fc = self.cfg.fragments
        self.cheaper_download_codecs = [c for c in codec_ladder(self.cfg.compression.download_codec, fc.adaptive_min_codec)[1:]
                                        if fc.adaptive and c != "none"]
        """Codecs besides the download codec each version's delta is also published in (adaptive runs)."""
        self.bases: dict[int, tuple[CompactBase, compact.CompactRef]] = {}
        """Each fragment's base of the compact downloads (``compression.download_codec``), as learners hold it, and
        the newest version's compact form (whose base and step blobs the next versions name again)."""

    def current(self, fragment: int, latest: dict[int, FragmentVersion]) -> GlobalFragment:
        """The newest published state of a fragment, from memory or the store."""
        row = latest[fragment]
        cached = self.state.get(fragment)
        if cached is not None and cached.version == row.version:
            return cached
        store = self.ctx.store()
        st = GlobalFragment(row.version, read_version(store, row), momentum_from_blob(store.get(row.state_key, row.state_sha256)))
        self.state[fragment] = st
        self.load_base(fragment, row.compact_json)
        return st

    def load_base(self, fragment: int, compact_json: str | None) -> None:
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

    def publish(
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
            attempt = f"-{self.lease.token}-{uuid.uuid4().hex[:8]}.safetensors"
            blob = store.put(global_key(self.ctx.run_id, fragment, version).replace(".safetensors", attempt), params)
            state = store.put(outer_state_key(self.ctx.run_id, fragment, version).replace(".safetensors", attempt),
                              momentum_to_blob(momentum or {}))
            base = self.write_compact(fragment, version, params, attempt)
            fault_point("sync.before_commit")
            with self.ctx.transaction() as s:
                sync_q.publish_version(
                    s,
                    self.ctx.run_id,
                    fragment,
                    version,
                    blob=sync_q.BlobRef(blob.key, blob.sha256, blob.nbytes),
                    state=sync_q.BlobRef(state.key, state.sha256, state.nbytes),
                    holder=self.lease.holder,
                    token=self.lease.token,
                    now=to_datetime(now),
                    merged=merged or [],
                    rejected=rejected or [],
                    record=record,
                    shard=self.lease.shard,
                    compact_json=None if base is None else base[1].to_json(),
                )
                for sub_id, why in rejected or []:
                    runs_q.record_event(
                        s, self.ctx.run_id, "submission_rejected", self.lease.holder, f"submission {sub_id}: {why}", to_datetime(now)
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

    def write_compact(self, fragment: int, version: int, params: dict[str, torch.Tensor],
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

    def reject(self, rejected: list[tuple[int, str]], now: float) -> None:
        """Reject submissions outside a merge, each with its reason."""
        metrics.observe_rejections(self.ctx.run_id, rejected)
        with self.ctx.transaction() as s:
            sync_q.reject_submissions(s, self.ctx.run_id, rejected, holder=self.lease.holder, token=self.lease.token,
                                      now=to_datetime(now), shard=self.lease.shard)
