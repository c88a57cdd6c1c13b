"""Fetching a fragment's pending submissions: each blob read from its learner's store and decoded straight into a
row of the merge workspace, concurrently, and judged (``validate``) as it arrives and then per learner."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.nn.utils import get_total_norm

from ddiloco.platform.compression import CompressionError, decode_delta_into
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import Submission
from ddiloco.platform.run_state import Layout
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.store import StoreError
from ddiloco.synchronizer import policy as pol
from ddiloco.synchronizer.merge import FlatDelta, FlatLayout, GlobalFragment, Member, MergeWorkspace
from ddiloco.synchronizer.validate import (
    LearnerFacts,
    Norms,
    ValidationPolicy,
    admit,
    clip,
    judge_groups,
    judge_norm,
    recent_norms,
)

log = logging.getLogger("ddiloco.synchronizer")

FETCH_WORKERS = 8
"""Submission blobs fetched and decoded at once during a merge."""
NORM_HISTORY = 8
"""Recently merged norms an outlier is judged against: short, because norms grow during warm-up."""


class Fetcher:
    """Reads and judges one holder's pending submissions; ``state`` (the service's cache of the newest versions)
    gives the optimizer's bound on a fragment without a norm history."""

    def __init__(self, ctx: RunContext, layout: Layout, workspace: MergeWorkspace, validation: ValidationPolicy,
                 state: dict[int, GlobalFragment]) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.layout = layout
        self.workspace = workspace
        self.validation = validation
        self.state = state
        self._pool = ThreadPoolExecutor(max_workers=FETCH_WORKERS, thread_name_prefix="fetch")

    def fetch(
        self, fragment: int, subs: list[Submission], version: int, regions: dict[str, str], learners: dict[str, LearnerFacts]
    ) -> tuple[list[Member], list[tuple[int, str]]]:
        """Read, decode and check the submissions: the members to merge, and (id, reason) for the rest. ``regions``:
        the region of every registered learner (whose store its blob is in); ``learners``: what the ledger says of
        each, to judge its claims by."""
        layout = FlatLayout.of(self.layout.shapes(fragment))
        rows = self.workspace.rows(layout, len(subs))
        with self.ctx.reading() as s:
            history = sync_q.recent_merged_norm_steps(s, self.ctx.run_id, fragment, limit=NORM_HISTORY)
        recent = recent_norms(history, self.validation.max_steps)
        # The optimizer's bound judges a fragment without a norm history, and caps the yardstick of one with it.
        plausible = self._plausible_step_norm(fragment, layout.numel)
        # Blob reads dominate on object stores: fetch and decode them concurrently (order is kept),
        # each straight into its own row of the workspace.
        checked = self._pool.map(lambda sb, row: self._validate(sb, version, layout, row, recent, regions, learners, plausible),
                                 subs, rows)
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
        # Every merge pass asks (it caps the norm yardstick): one fused norm and one read back, not one per tensor.
        param_norm = float(get_total_norm([t.float() for t in cached.params.values()])) if cached else 0.0
        return pol.plausible_step_norm(self.cfg.inner.lr, self.cfg.inner.weight_decay, numel, param_norm)

    def _validate(
        self, sb: Submission, version: int, layout: FlatLayout, row: torch.Tensor, recent: Norms, regions: dict[str, str],
        learners: dict[str, LearnerFacts], plausible: float | None = None,
    ) -> str | Member:
        """A reason to reject the submission, or the decoded member."""
        why, key = admit(sb, self.ctx.run_id, version, learners.get(sb.learner_id), layout.numel, self.validation)
        if why:
            return why
        try:
            tensors, meta = self.ctx.store(regions[sb.learner_id]).get_with_metadata(key, sb.sha256, sb.nbytes)
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
