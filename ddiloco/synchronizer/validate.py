"""Judging submissions before a merge: pure functions of values that return their reasons, like ``policy.py``.

The service reads the ledger and the store; what it read is judged here: what a submission claims and where
its blob must lie (:func:`admit`), the norm of one decoded increment (:func:`judge_norm`), one learner's
pending increments as a whole (:func:`learner_groups`, :func:`summed_norm`, :func:`judge_groups`) and
``merge.clip_factor``'s clipping (:func:`clip`). The merge groups learners with the same :func:`learner_groups`."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from ddiloco.platform.ids import InvalidIdError, submission_key
from ddiloco.platform.ledger.learner import UNKNOWN_LEARNER
from ddiloco.platform.store import MAX_HEADER_BYTES
from ddiloco.synchronizer import policy as pol

if TYPE_CHECKING:
    from ddiloco.platform.config import RunConfig
    from ddiloco.platform.ledger.models import Submission
    from ddiloco.synchronizer.merge import Member


@dataclass(frozen=True)
class ValidationPolicy:
    """The settings submissions are judged by (``fragments`` and ``merge`` of the run's config)."""

    period: int
    """Inner steps between two sends of a fragment (``fragments.period``)."""
    outlier_factor: float
    max_staleness: int
    max_periods: int
    """``merge.max_periods``: a learner's steps weigh at most this many periods in the merge, and its norm is judged
    over at most as many steps."""
    clip_factor: float | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> ValidationPolicy:
        m = cfg.merge
        return cls(cfg.fragments.period, m.norm_outlier_factor, m.max_staleness, m.max_periods, m.clip_factor)

    @property
    def max_steps(self) -> int:
        return self.period * self.max_periods


@dataclass(frozen=True)
class Norms:
    """A fragment's recently merged update norms: per inner step, and whole."""

    per_step: list[float]
    whole: list[float]


def recent_norms(history: Sequence[tuple[float, int]], max_steps: int) -> Norms:
    """The yardstick from (norm, c_steps) of a fragment's latest merged submissions (``max_steps``: as judged,
    ``ValidationPolicy.max_steps``)."""
    return Norms([n / pol.norm_steps(c, max_steps) for n, c in history], [n for n, _ in history])


class LearnerFacts(NamedTuple):
    """What a pass read of a submission's learner in the ledger, to judge its claims by."""

    most_tokens: int
    """The most tokens one inner step of its ranks trains (its registered world, the run's batch)."""
    trained_s: float
    """The longest it can have trained: since its incarnation started, never before the run, with the clocks'
    tolerance (``learners.dead_after_s``) added."""
    dead: str | None = None
    """Why it counts as dead (``platform.liveness``), None while it is live."""
    dead_since: float | None = None
    """When it became dead (its last sign of life plus ``learners.dead_after_s``), None while it is live."""


class Admission(NamedTuple):
    reason: str | None
    """Why the submission is rejected before its blob is read (None: read it)."""
    key: str = ""
    """Where its blob is read from: derived from its ids, never taken from the row."""


DEAD_LEARNER = "dead learner"
"""How the reason begins for work of a learner the ledger counts as dead."""


def admit(sb: Submission, run_id: str, version: int, learner: LearnerFacts | None, numel: int,
          policy: ValidationPolicy) -> Admission:
    """Judge what a submission claims before its blob is read. ``learner``: what the ledger says of its learner
    (None: no such learner registered); ``numel``: the fragment's elements."""
    if learner is None:
        return Admission(f"{UNKNOWN_LEARNER} {sb.learner_id!r}")
    if learner.dead is not None and (learner.dead_since is None or sb.created_at.timestamp() > learner.dead_since):
        # Work registered after its learner fell silent past the liveness rule is a zombie's: refused until the learner
        # is heard of (a heartbeat, or a new incarnation's registration). Work registered before is judged as it would
        # have been: a learner killed, or cut off by a partition, right after sending loses none of it.
        return Admission(f"{DEAD_LEARNER} {sb.learner_id!r}: {learner.dead}; heartbeat or re-register to be merged again")
    why = (pol.check_claims(sb.c_steps, sb.c_tokens, sb.tokens_new, sb.base_version, learner.most_tokens, learner.trained_s,
                            sb.codec)
           or pol.check_staleness(version, sb.base_version, policy.max_staleness))
    if why:
        return Admission(why)
    # Reads are bounded by the registered size, and that by what any encoding of the fragment takes.
    most = 8 * numel + MAX_HEADER_BYTES
    if sb.nbytes > most:
        return Admission(f"blob: {sb.nbytes} bytes registered, more than the {most} any encoding of this fragment takes")
    try:
        # The key is derived, never taken from the row: a claimed key could name any blob.
        key = submission_key(run_id, sb.fragment, sb.learner_id, sb.uid)
    except InvalidIdError as err:
        return Admission(f"blob: {err}")
    if sb.blob_key != key:
        return Admission(f"blob: registered under {sb.blob_key[:160]!r}, not under {key!r} that its ids give")
    return Admission(None, key)


def judge_norm(norm: float, c_steps: int, recent: Norms, policy: ValidationPolicy, plausible: float | None = None) -> str | None:
    """A reason to reject an update of this norm over ``c_steps`` inner steps, or None.

    Judged per inner step and whole (see ``policy.check_norm``): increments of one fragment cover different
    numbers of steps, and one sent soon after a blended receipt carries more than its steps."""
    whole = None if plausible is None else plausible * policy.max_steps
    return pol.check_finite(norm) or pol.check_norm(norm / pol.norm_steps(c_steps, policy.max_steps), recent.per_step,
                                                    policy.outlier_factor, plausible=plausible, raw=(norm, recent.whole),
                                                    plausible_whole=whole)


def learner_groups(learners: Sequence[str]) -> dict[str, list[int]]:
    """The indices of each learner's members, learners in order of first appearance: a learner's pending
    increments add up to its outer gradient, so they are judged, clipped and weighed as one."""
    groups: dict[str, list[int]] = {}
    for i, lid in enumerate(learners):
        groups.setdefault(lid, []).append(i)
    return groups


def _grouped(members: Sequence[Member]) -> list[list[Member]]:
    return [[members[i] for i in idx] for idx in learner_groups([m.learner for m in members]).values()]


def summed_norm(group: Sequence[Member]) -> float | None:
    """The norm of one learner's summed increments (None when one of them is not a flat row)."""
    if any(isinstance(m.delta, Mapping) for m in group):
        return None
    if len(group) == 1:
        return group[0].norm
    return float(torch.stack([m.delta.row for m in group]).sum(dim=0).norm())  # type: ignore[union-attr]


def judge_groups(
    members: Sequence[Member], recent: Norms, policy: ValidationPolicy, plausible: float | None
) -> tuple[list[Member], list[tuple[int, str]]]:
    """One learner's pending increments merge as one member: their summed norm is judged as a whole (many small
    updates must not pass where their sum would not). Returns the members kept and (submission, reason) of the
    rest; the steps they claim weigh at most ``merge.max_periods`` periods together (``MergePolicy.max_steps``)."""
    kept: list[Member] = []
    rejected: list[tuple[int, str]] = []
    for group in _grouped(members):
        norm = summed_norm(group) if len(group) > 1 else None
        why = None if norm is None else judge_norm(norm, sum(m.c_steps for m in group), recent, policy, plausible)
        if why is not None:
            rejected += [(m.submission, why) for m in group]
        else:
            kept += group
    return kept, rejected


class Clipped(NamedTuple):
    learner: str
    norm: float
    bound: float


def clip(members: Sequence[Member], recent: Norms, policy: ValidationPolicy) -> tuple[list[Member], list[Clipped]]:
    """``merge.clip_factor``: each learner's update is scaled down to at most that multiple of the fragment's
    recent median norm per step, times its steps up to one send period (so claiming more steps buys no room).
    A robust option beside the outlier check: an update too large to be honest yet under the outlier bar moves
    the merge no more than an honest one could.

    The rows are scaled in place (they are the workspace rows the merge reads); returns the members and what
    was clipped, from what norm to what bound."""
    if policy.clip_factor is None or len(recent.per_step) < pol.MIN_NORM_HISTORY:
        return list(members), []
    median = statistics.median(recent.per_step)
    out: list[Member] = []
    clipped: list[Clipped] = []
    for group in _grouped(members):
        norm = summed_norm(group)
        if norm is None:
            out += group
            continue
        bound = policy.clip_factor * median * min(sum(m.c_steps for m in group), policy.period)
        if not norm > bound > 0:
            out += group
            continue
        scale = bound / norm
        for m in group:
            m.delta.row.mul_(scale)  # type: ignore[union-attr]
            m.delta.sq_norms.mul_(scale * scale)  # type: ignore[union-attr]
            out.append(replace(m, norm=m.norm * scale))
        clipped.append(Clipped(group[0].learner, norm, bound))
    return out, clipped
