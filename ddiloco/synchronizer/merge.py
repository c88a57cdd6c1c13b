"""Merging outer gradients: the rule as free functions, and one fragment's whole merge on flat buffers.

:func:`merge_fragment` is the method's steps 4 and 5 as one pure function: the per-learner sum of
increments, token weights, RDA or the plain mean (per tensor), the participation scale and the outer
step. The synchronizer fetches and validates before it and publishes after it.

It runs at memory speed on real fragment sizes: members arrive decoded into the rows of one
[members x N] float32 matrix (:class:`MergeWorkspace`, reused from merge to merge) with their
squared norms, the merged direction is one matrix-vector product, and the Nesterov step runs on flat
buffers in place; nothing model-sized is allocated per merge. On a CPU each pass walks the fragment
in cache-sized chunks, so a chunk of the merged gradient is still in cache when its norm is taken.

``merge.robust`` swaps the product for a coordinate-wise trimmed mean or median over the learners
(:func:`trimmed_mean`), chunk by chunk on the same rows, or (drop_opposed) gives no weight to a
learner whose update points against the others' (:func:`opposed_learners`); with ``none`` the
product runs as before."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from ddiloco.platform.fragments import param_name
from ddiloco.synchronizer.outer import async_momentum, outer_lr, outer_step_
from ddiloco.synchronizer.policy import capped_counts, participation_scale, token_weight
from ddiloco.synchronizer.validate import learner_groups

if TYPE_CHECKING:
    from ddiloco.platform.config import RunConfig

CANCEL_TOL = 1e-6
"""RDA: a mean direction shorter than this (the unit directions cancel) merges to zero. It is a
relative length: the mean of unit vectors that all agree has length 1. What is left below it is
rounding, and stretching that to the mean norm would step in an arbitrary direction."""

SHRINK_AFTER = 32
"""A buffer four times larger than this many requests in a row needed is given back: a backlog's
burst (hundreds of pending submissions after a takeover) does not pin its memory for the rest of
the run, and sizes that merely alternate are never reallocated."""

MERGE_CHUNK = 1 << 17
"""Elements per pass step on a CPU (512 KB of float32): small enough to stay in cache between the
operations applied to it (L2 or L3), large enough that per-call overhead stays small."""


# --- the rule ------------------------------------------------------------------------------------


def _normalized_weights(weights: Sequence[float]) -> list[float]:
    w = torch.tensor(list(weights), dtype=torch.float64)
    if len(w) == 0 or not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"merge weights must be finite, non-negative and not all zero, got {list(weights)}")
    return (w / w.sum()).tolist()


def merge_coefficients(sq_norms: Sequence[float], weights: Sequence[float], method: str) -> tuple[list[float], float | None]:
    """(c, target): the merged direction is sum_i c_i v_i, stretched to norm ``target`` (None: kept as is).

    mean: c = w / sum w. RDA averages norms and directions separately: c = (w / sum w) / |v_i| (a
    zero vector has no direction) and target = sum w |v_i| / sum w. Outer gradients of different
    learners are nearly orthogonal, so a plain mean shrinks like 1/sqrt(M); RDA keeps the typical
    step length and only averages where to go."""
    if method not in ("rda", "mean"):
        raise ValueError(f"merge.method must be 'rda' or 'mean', got {method!r}")
    w = _normalized_weights(weights)
    if method == "mean":
        return w, None
    norms = [math.sqrt(max(0.0, s)) for s in sq_norms]
    return [wi / n if n > 0 else 0.0 for wi, n in zip(w, norms, strict=True)], sum(wi * n for wi, n in zip(w, norms, strict=True))


def robust_terms(sq_norms: Sequence[float], weights: Sequence[float], method: str, trim: int) -> tuple[list[float], float | None]:
    """(s, target) for a robust merge: the merged direction is trimmed_mean(v, s_i v_i), stretched to ``target``.

    Each coordinate drops the learners whose raw values are the ``trim`` smallest and largest (an
    update scaled up stands out there), and averages the rest as the method does, with the token
    weights: RDA's unit directions (s = 1 / |v_i|) stretched to the trimmed weighted mean of the
    norms (the same rule on the norms, so an oversized norm is dropped too); mean's values as they are."""
    if method not in ("rda", "mean"):
        raise ValueError(f"merge.method must be 'rda' or 'mean', got {method!r}")
    if method == "mean":
        return [1.0] * len(sq_norms), None
    norms = torch.tensor([math.sqrt(max(0.0, s)) for s in sq_norms], dtype=torch.float64)
    w = torch.tensor(_normalized_weights(weights), dtype=torch.float64)
    target = float(trimmed_mean(norms[:, None], norms[:, None], w, trim)[0])
    return [1.0 / float(n) if n > 0 else 0.0 for n in norms], target


def stretch(direction_norm: float, target: float | None) -> float:
    """The factor applied to the merged direction: 1 for the mean; RDA's target over the direction's
    norm, or 0 when the unit directions cancel (see CANCEL_TOL)."""
    if target is None:
        return 1.0
    return 0.0 if direction_norm <= CANCEL_TOL else target / direction_norm


def merge_vectors(vectors: Sequence[torch.Tensor], weights: Sequence[float], method: str) -> torch.Tensor:
    """The merge of same-shaped vectors by the rule above (a new float32 tensor)."""
    rows = torch.stack([v.reshape(-1).to(torch.float32) for v in vectors])
    sq = [float(torch.linalg.vector_norm(r, dtype=torch.float64)) ** 2 for r in rows]
    coeffs, target = merge_coefficients(sq, weights, method)
    direction = rows.t() @ torch.tensor(coeffs, dtype=torch.float32)
    return direction.mul_(stretch(float(torch.linalg.vector_norm(direction)), target)).view(vectors[0].shape)


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_m w_m * v_m / sum_m w_m."""
    return merge_vectors(vectors, weights, "mean")


def radial_directional_average(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Average norms and directions separately: norm * normalize(sum w * v/|v|)."""
    return merge_vectors(vectors, weights, "rda")


def norm_of(tensors: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all tensors together, as if flattened into one vector."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors.values()))


ROBUST_RULES = ("none", "trimmed_mean", "median", "drop_opposed")
ROBUST_MIN_LEARNERS = 3
"""Learners a robust merge needs: of two, the median is their mean, a trim leaves nothing, and
neither can be outvoted."""


def trim_count(learners: int, robust: str, trim_fraction: float) -> int:
    """Values dropped at each end of every coordinate among ``learners`` (0: the plain rule), or for
    drop_opposed the most learners it may drop.

    trimmed_mean and drop_opposed: ``trim_fraction`` of the learners, rounded down but at least one
    (the option is there to drop one hostile learner, and a merge has few learners); median: all but
    the middle one (odd) or two (even). Always fewer than half; 0 below :data:`ROBUST_MIN_LEARNERS`."""
    if robust not in ROBUST_RULES:
        raise ValueError(f"merge.robust must be one of {', '.join(ROBUST_RULES)}, got {robust!r}")
    if robust == "none" or learners < ROBUST_MIN_LEARNERS:
        return 0
    most = (learners - 1) // 2
    return most if robust == "median" else min(most, max(1, math.floor(trim_fraction * learners)))


def opposed_learners(cos: torch.Tensor, most: int) -> list[tuple[int, float]]:
    """(learner, its mean cosine with the rest) for up to ``most`` learners dropped as opposed to the
    others: repeatedly the one whose update points most against the rest's (lowest mean cosine with
    them), while that mean is negative. ``cos``: [L, L] cosines between the learners' updates.

    One vote per learner, and a negative mean to be dropped: honest updates of one fragment agree
    (in the quality benchmark their pairwise cosine is 0.46 on average, below 0 in 2% of pairs),
    while a learner sending the opposite of what it learned points against every honest one. A merge
    too small to vote is not judged by the fragment's momentum instead: honest updates point against
    it about as often as along it (measured for #16 in docs/quality.md), so it would drop them too."""
    rest = list(range(cos.shape[0]))
    out: list[tuple[int, float]] = []
    while len(out) < most and len(rest) > 2:
        score = {i: sum(float(cos[i, j]) for j in rest if j != i) / (len(rest) - 1) for i in rest}
        worst = min(rest, key=lambda i: (score[i], i))
        if not score[worst] < 0:
            break
        out.append((worst, score[worst]))
        rest.remove(worst)
    return out


def trimmed_mean(ranked: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, trim: int) -> torch.Tensor:
    """Per column: drop the ``trim`` rows whose ``ranked`` entries are smallest and the ``trim``
    largest, and return the ``weights``-weighted mean of the other rows' ``values`` ([L, n] -> [n]).

    Which rows are dropped is decided by count, one vote per row, so a weight cannot buy its way out
    of the trim; the survivors are averaged with their weights (a column whose survivors all weigh
    0 gives 0). Ties are broken by row order, so the result is deterministic."""
    L = ranked.shape[0]
    if not 0 <= 2 * trim < L:
        raise ValueError(f"cannot trim {trim} of {L} rows at each end")
    keep = ranked.argsort(dim=0, stable=True)[trim : L - trim]  # [L - 2 trim, n]
    w = weights[keep]
    return (values.gather(0, keep) * w).sum(0) / w.sum(0).clamp_min(torch.finfo(w.dtype).tiny)


# --- flat buffers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a fragment lives in one flat float32 vector: in order, back to back."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, shapes: Mapping[str, Sequence[int]]) -> FlatLayout:
        return cls(tuple(shapes), tuple(tuple(int(d) for d in s) for s in shapes.values()))

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start of each tensor, and the total at the end."""
        out = [0]
        for s in self.shapes:
            out.append(out[-1] + math.prod(s))
        return tuple(out)

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def items(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(zip(self.names, self.shapes, strict=True))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors by name, as views of ``flat``."""
        o = self.offsets
        return {n: flat[o[i] : o[i + 1]].view(s) for i, (n, s) in enumerate(self.items())}


@dataclass(frozen=True)
class FlatDelta:
    """A decoded outer gradient: one flat float32 row in ``layout`` order, with each tensor's squared norm."""

    layout: FlatLayout
    row: torch.Tensor
    sq_norms: torch.Tensor
    """float64, one per tensor of the layout."""

    @property
    def norm(self) -> float:
        return math.sqrt(float(self.sq_norms.sum()))


def default_merge_device() -> torch.device:
    """Where merges run when the config says auto: the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class MergeWorkspace:
    """Buffers reused from merge to merge, so a merge allocates nothing model-sized.

    ``rows`` holds the members' decoded outer gradients; the merged gradient and the gathered rows
    are scratch; the new versions' parameters and momentum come from a pool that the owner refills
    with :meth:`recycle` when it drops a version it no longer reads. One merge at a time (decodes of
    one merge may run in threads, each into its own row)."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = default_merge_device() if device in (None, "auto") else torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("merges on cuda need a CUDA device, and torch sees none")
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" names the current GPU; tensors report "cuda:N", and buffers are matched by device.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.chunk = MERGE_CHUNK if self.device.type == "cpu" else None
        """Elements per pass step; None: whole tensors (a GPU wants few large kernels)."""
        self._rows = torch.empty(0, device=self.device)
        self._gather = torch.empty(0, device=self.device)
        self._learners = torch.empty(0, device=self.device)
        self._grad = torch.empty(0, device=self.device)
        self._scratch = torch.empty(0, device=self.device)
        self._spare: dict[int, list[torch.Tensor]] = {}
        self._lent: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._oversized: dict[str, int] = {}

    def _grown(self, attr: str, numel: int) -> torch.Tensor:
        buf = getattr(self, attr)
        small = 4 * numel < buf.numel()
        self._oversized[attr] = self._oversized.get(attr, 0) + 1 if small else 0
        if buf.numel() < numel or self._oversized[attr] >= SHRINK_AFTER:
            buf = torch.empty(numel, device=self.device)
            setattr(self, attr, buf)
            self._oversized[attr] = 0
        return buf[:numel]

    def rows(self, layout: FlatLayout, count: int) -> torch.Tensor:
        """[count, N] float32 rows to decode members into (valid until the next call)."""
        return self._grown("_rows", count * layout.numel).view(count, layout.numel)

    def gathered(self, count: int, numel: int) -> torch.Tensor:
        return self._grown("_gather", count * numel).view(count, numel)

    def learner_rows(self, count: int, numel: int) -> torch.Tensor:
        """[count, numel] scratch: each learner's summed increments over one chunk (robust merges)."""
        return self._grown("_learners", count * numel).view(count, numel)

    def grad(self, numel: int) -> torch.Tensor:
        return self._grown("_grad", numel)

    def scratch(self, numel: int) -> torch.Tensor:
        return self._grown("_scratch", numel)

    def take(self, numel: int) -> torch.Tensor:
        """A flat float32 buffer for a new version (from the pool when it has one of that size)."""
        pool = self._spare.get(numel)
        buf = pool.pop() if pool else torch.empty(numel, device=self.device)
        self._lent[id(buf)] = buf
        return buf

    def recycle(self, fragment: GlobalFragment | None) -> None:
        """Take back the buffers of a merged version nobody will read again (others are left alone)."""
        if fragment is None:
            return
        for tensors in (fragment.params, fragment.momentum or {}):
            base = next(iter(tensors.values()), None)
            base = None if base is None else base._base
            if base is not None and self._lent.get(id(base)) is base:
                del self._lent[id(base)]
                self._spare.setdefault(base.numel(), []).append(base)


# --- one fragment's merge ------------------------------------------------------------------------


@dataclass(frozen=True)
class GlobalFragment:
    """A published version of one fragment: parameters and the outer optimizer's momentum."""

    version: int
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor] | None
    """None until the outer optimizer has stepped."""


@dataclass(frozen=True)
class Member:
    """One validated submission: what a learner learned on the fragment since its previous send."""

    submission: int
    learner: str
    delta: FlatDelta | Mapping[str, torch.Tensor]
    """Decoded outer-gradient increment: a flat row (as the synchronizer decodes it), or tensors by name."""
    norm: float
    c_steps: int
    c_tokens: int
    base_version: int


@dataclass(frozen=True)
class MergePolicy:
    """The merge and outer-optimizer settings (``merge`` and ``outer`` of the run's config)."""

    method: str = "rda"
    weighting: str = "tokens"
    plain_mean: tuple[str, ...] = ("embed",)
    """Tensors whose name contains one of these use the plain weighted mean when method is rda."""
    participation_scaling: bool = True
    lr: float = 0.5
    momentum: float = 0.9
    nesterov: bool = True
    warmup: int = 0
    """``outer.warmup_versions``: the outer lr rises linearly over a fragment's first this many versions."""
    momentum_adjust: str = "async"
    """``outer.momentum_adjust``: async (:func:`merge_momentum`) or none."""
    period: int = 1
    """``fragments.period``: the steps of one send period, the unit of a merge's periods under momentum_adjust."""
    max_steps: int | None = None
    """A learner's steps weigh at most this many (``merge.max_periods`` send periods); None: no cap."""
    robust: str = "none"
    """``merge.robust``: none, trimmed_mean, median or drop_opposed (:func:`trim_count`, :func:`opposed_learners`)."""
    trim_fraction: float = 0.25
    clip_factor: float | None = None
    """``merge.clip_factor``: the synchronizer clips before the merge (it needs the fragment's norm
    history); here it only names what a merge too small to trim falls back to."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> MergePolicy:
        m, o = cfg.merge, cfg.outer
        return cls(
            method=m.method, weighting=m.weighting, plain_mean=tuple(m.plain_mean_fragments),
            participation_scaling=m.participation_scaling, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
            warmup=o.warmup_versions, max_steps=cfg.fragments.period * m.max_periods, robust=m.robust,
            trim_fraction=m.trim_fraction, clip_factor=m.clip_factor, momentum_adjust=o.momentum_adjust,
            period=cfg.fragments.period,
        )


@dataclass(frozen=True)
class MergeOutcome:
    version: int
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    detail: dict[str, Any]
    """The merge record's detail: method, plain-mean tensors, scale, and each member's weight, norm, staleness."""


def plain_mean_tensors(names: Sequence[str], policy: MergePolicy) -> list[str]:
    """The tensors merged with the plain weighted mean: all of them for method mean, else those the policy names."""
    if policy.method == "mean":
        return list(names)
    # Tags match the parameter's name, so every row piece of an embedding (name@rows:a:b) matches too.
    return [n for n in names if any(tag in param_name(n) for tag in policy.plain_mean)]


def merge_momentum(members: Sequence[Member], by_learner: Mapping[str, list[int]], policy: MergePolicy, version: int) -> float:
    """The merge's outer momentum: ``outer.momentum``, or under ``momentum_adjust: async`` :func:`async_momentum` of its
    learners' send periods (their steps capped as for their weights) and staleness, both weighted by their tokens."""
    if policy.momentum_adjust == "none" or policy.momentum <= 0:
        return policy.momentum
    tokens = periods = stale = 0.0
    for idx in by_learner.values():
        own = sum(members[i].c_tokens for i in idx)
        c_tokens, c_steps = capped_counts(sum(members[i].c_steps for i in idx), own, policy.max_steps)
        tokens += c_tokens
        periods += c_tokens * c_steps / policy.period
        stale += c_tokens * sum(members[i].c_tokens * (version - members[i].base_version) for i in idx) / max(1, own)
    if tokens <= 0:
        return policy.momentum
    return async_momentum(policy.momentum, periods / tokens, stale / tokens)


def merge_fragment(
    current: GlobalFragment,
    members: Sequence[Member],
    policy: MergePolicy,
    *,
    live_learners: int,
    workspace: MergeWorkspace | None = None,
) -> MergeOutcome:
    """Merge the members' outer gradients into ``current`` and take one outer step (version + 1).

    A learner's members are increments (each carries what it learned since its previous send or
    receipt), so they add up to that learner's outer gradient; learners are then weighted and
    merged. Inputs are not modified; the result's tensors are views of buffers from ``workspace``
    (a fresh one when None) and share nothing with the inputs."""
    if not members:
        raise ValueError("merge_fragment needs at least one member")
    ws = workspace or MergeWorkspace(_row_device(members))
    layout = _layout_for(current, members)
    rows, sq_norms = _member_rows(layout, [m.delta for m in members], ws)  # [M, N] rows; per member, per tensor
    by_learner = learner_groups([m.learner for m in members])
    weight = {
        lid: token_weight(*capped_counts(sum(members[i].c_steps for i in idx), sum(members[i].c_tokens for i in idx),
                                         policy.max_steps), policy.weighting)
        for lid, idx in by_learner.items()
    }
    scale = participation_scale(len(by_learner), live_learners) if policy.participation_scaling else 1.0
    mean_names = plain_mean_tensors(layout.names, policy)
    group_of = [1 if n in mean_names else 0 for n in layout.names]  # 0: RDA, 1: plain mean
    # Per learner and tensor, the squared norm of the learner's summed increments.
    learner_sq = [sq_norms[idx[0]] if len(idx) == 1 else _summed_sq_norms(rows, idx, layout, ws) for idx in by_learner.values()]
    count = trim_count(len(by_learner), policy.robust, policy.trim_fraction)
    select = _learner_select(list(by_learner.values()), len(members), ws.device) if count else None
    dropped: list[tuple[str, float]] = []
    if select is not None and policy.robust == "drop_opposed":
        ids = list(by_learner)
        dropped = [(ids[i], c) for i, c in opposed_learners(_learner_cosines(rows, select, layout, ws), count)]
        weight.update({lid: 0.0 for lid, _ in dropped})  # merged with no weight: outvoted
    trim = count if policy.robust in ("trimmed_mean", "median") else 0
    coeffs, targets = [], []
    for g, method in enumerate(("rda", "mean")):
        tensors = [i for i, gi in enumerate(group_of) if gi == g]
        sq = [sum(per_tensor[t] for t in tensors) for per_tensor in learner_sq]
        if trim:  # per learner: the scale of its summed row, as robust_terms gives it
            c, target = robust_terms(sq, list(weight.values()), method, trim) if tensors else ([0.0] * len(by_learner), None)
            coeffs.append(torch.tensor(c, dtype=torch.float32, device=ws.device)[:, None])
            targets.append(target)
            continue
        c, target = merge_coefficients(sq, list(weight.values()), method) if tensors else ([0.0] * len(by_learner), None)
        per_member = [0.0] * len(members)
        for cl, idx in zip(c, by_learner.values(), strict=True):
            for i in idx:
                per_member[i] = cl
        coeffs.append(torch.tensor(per_member, dtype=torch.float32, device=ws.device))
        targets.append(target)
    if trim:
        w = torch.tensor(_normalized_weights(list(weight.values())), dtype=torch.float32, device=ws.device)

    # Pass 1: the merged direction, one matrix-vector product per chunk (or, robust, the trimmed mean
    # of the learners' summed rows), and each group's squared norm.
    grad = ws.grad(layout.numel)
    dir_sq = [torch.zeros((), dtype=torch.float64, device=ws.device) for _ in range(2)]
    for i, a, b in _chunks(layout, ws.chunk):
        g = grad[a:b]
        if trim and select is not None:
            x = torch.mm(select, rows[:, a:b], out=ws.learner_rows(len(by_learner), b - a))  # [L, b - a]
            g.copy_(trimmed_mean(x, x * coeffs[group_of[i]], w, trim))
        else:
            torch.mv(rows[:, a:b].t(), coeffs[group_of[i]], out=g)
        if targets[group_of[i]] is not None:
            dir_sq[group_of[i]] += torch.dot(g, g)
    factor = [stretch(math.sqrt(float(dir_sq[g])), targets[g]) * scale for g in range(2)]

    # Pass 2: the new version = the current one, stretched gradient, one Nesterov step, chunk by chunk
    # into buffers of the pool (so the copy of the current version is still in cache when it steps).
    params = ws.take(layout.numel)
    momentum = ws.take(layout.numel) if policy.momentum > 0 else None
    src_p = [current.params[n].detach().reshape(-1) for n in layout.names]
    src_m = [None if current.momentum is None or n not in current.momentum else current.momentum[n].detach().reshape(-1)
             for n in layout.names]
    offsets = layout.offsets
    lr = outer_lr(policy.lr, current.version, policy.warmup)
    beta = merge_momentum(members, by_learner, policy, current.version)
    for i, a, b in _chunks(layout, ws.chunk):
        lo, hi = a - offsets[i], b - offsets[i]
        params[a:b].copy_(src_p[i][lo:hi])
        if momentum is not None:
            if src_m[i] is None:
                momentum[a:b].zero_()
            else:
                momentum[a:b].copy_(src_m[i][lo:hi])
        if factor[group_of[i]] != 1.0:
            grad[a:b].mul_(factor[group_of[i]])
        outer_step_(params[a:b], grad[a:b], None if momentum is None else momentum[a:b],
                    lr=lr, beta=beta, nesterov=policy.nesterov)
    new_params = layout.views(params)
    new_momentum = {} if momentum is None else layout.views(momentum)
    detail = {
        "method": policy.method,
        "plain_mean_tensors": mean_names if policy.method == "rda" else [],
        "participation_scale": scale,
        "base_version": current.version,
        "learners": len(by_learner),
        "members": [
            {"submission": members[i].submission, "learner": lid, "weight": weight[lid], "norm": members[i].norm,
             "staleness": current.version - members[i].base_version}
            for lid, idx in by_learner.items()
            for i in idx
        ],
    }
    if lr != policy.lr:
        detail["outer_lr"] = lr  # warming up
    if beta != policy.momentum:
        detail["outer_momentum"] = beta  # momentum_adjust
    if policy.robust != "none":
        detail["robust"] = robust_detail(policy, len(by_learner), count, dropped)
    return MergeOutcome(current.version + 1, new_params, new_momentum, detail)


def robust_detail(policy: MergePolicy, learners: int, count: int, dropped: Sequence[tuple[str, float]]) -> dict[str, Any]:
    """What a robust merge did, for its merge record: the rule, what it trimmed or dropped, and what a
    merge too small for it fell back to."""
    out: dict[str, Any] = {"rule": policy.robust, "learners": learners, "applied": count > 0}
    if policy.robust == "drop_opposed":
        out["dropped"] = [{"learner": lid, "mean_cosine": round(c, 4)} for lid, c in dropped]
    else:
        out["trimmed_per_end"] = count
    if not count:
        clip = (f"updates clipped to {policy.clip_factor:g}x the fragment's recent median norm per step (merge.clip_factor)"
                if policy.clip_factor is not None else "no clipping (merge.clip_factor is off)")
        out["fallback"] = (f"{learners} learner(s), too few for {policy.robust} (needs {ROBUST_MIN_LEARNERS}): "
                           f"merged by {policy.method}, {clip}")
    return out


def _row_device(members: Sequence[Member]) -> torch.device:
    d = members[0].delta
    return d.row.device if isinstance(d, FlatDelta) else torch.device("cpu")


def _layout_for(current: GlobalFragment, members: Sequence[Member]) -> FlatLayout:
    """The members' layout when it is the fragment's (no copy), else the fragment's own order."""
    shapes = {n: tuple(t.shape) for n, t in current.params.items()}
    first = members[0].delta
    if isinstance(first, FlatDelta) and dict(first.layout.items()) == shapes:
        return first.layout
    return FlatLayout.of(shapes)


def _member_rows(
    layout: FlatLayout, deltas: Sequence[FlatDelta | Mapping[str, torch.Tensor]], ws: MergeWorkspace
) -> tuple[torch.Tensor, list[list[float]]]:
    """The members as one [M, N] matrix on the workspace's device, and each member's squared norm per tensor.

    Rows decoded back to back into one buffer are used where they lie; anything else is gathered."""
    flat = [d for d in deltas if isinstance(d, FlatDelta) and d.layout == layout]
    if len(flat) == len(deltas):
        sq = [d.sq_norms.tolist() for d in flat]
        rows = _as_matrix([d.row for d in flat], layout.numel, ws.device)
        if rows is not None:
            return rows, sq
    rows = ws.gathered(len(deltas), layout.numel)
    sq = []
    for row, d in zip(rows, deltas, strict=True):
        if isinstance(d, FlatDelta):
            d = d.layout.views(d.row)
        missing = sorted(set(layout.names) ^ set(d))
        if missing:
            raise ValueError(f"member delta does not match the fragment's tensors: {missing}")
        for n, view in layout.views(row).items():
            view.copy_(d[n].reshape(view.shape))
        sq.append([float(torch.linalg.vector_norm(v, dtype=torch.float64)) ** 2 for v in layout.views(row).values()])
    return rows, sq


def _as_matrix(rows: Sequence[torch.Tensor], numel: int, device: torch.device) -> torch.Tensor | None:
    """A [M, N] view of rows lying back to back in one buffer (None when they do not)."""
    first = rows[0]
    if first.device != device or first.dtype != torch.float32 or not first.is_contiguous():
        return None
    step = numel * first.element_size()
    for i, r in enumerate(rows):
        if r.numel() != numel or r.dtype != first.dtype or r.device != first.device or r.data_ptr() != first.data_ptr() + i * step:
            return None
    return first.as_strided((len(rows), numel), (numel, 1))


def _summed_sq_norms(rows: torch.Tensor, idx: list[int], layout: FlatLayout, ws: MergeWorkspace) -> list[float]:
    """Per tensor, |sum of the rows idx|^2: one pass over those rows, summed chunk by chunk in a scratch
    the size of a chunk (a learner with k pending increments costs k row reads, not k^2)."""
    largest = max((layout.offsets[i + 1] - layout.offsets[i] for i in range(len(layout.names))), default=1)
    scratch = ws.scratch(min(ws.chunk or largest, largest))
    sq = [torch.zeros((), dtype=torch.float64, device=ws.device) for _ in layout.names]
    for i, a, b in _chunks(layout, ws.chunk):
        s = torch.add(rows[idx[0], a:b], rows[idx[1], a:b], out=scratch[: b - a])
        for j in idx[2:]:
            s.add_(rows[j, a:b])
        sq[i] += torch.dot(s, s)
    return [float(x) for x in sq]


def _learner_select(groups: Sequence[list[int]], members: int, device: torch.device) -> torch.Tensor:
    """[learners, members]: 1 where a member is one of the learner's increments (select @ rows sums them)."""
    select = torch.zeros(len(groups), members, dtype=torch.float32, device=device)
    for lrow, idx in enumerate(groups):
        select[lrow, idx] = 1.0
    return select


def _learner_cosines(rows: torch.Tensor, select: torch.Tensor, layout: FlatLayout, ws: MergeWorkspace) -> torch.Tensor:
    """[L, L] cosines between the learners' summed updates (``select`` @ ``rows``), over the whole
    fragment: one pass, the Gram matrix summed chunk by chunk in float64 (a zero update has cosine 0)."""
    L = select.shape[0]
    gram = torch.zeros(L, L, dtype=torch.float64, device=ws.device)
    for _, a, b in _chunks(layout, ws.chunk):
        x = torch.mm(select, rows[:, a:b], out=ws.learner_rows(L, b - a))
        gram += (x @ x.t()).double()
    norm = gram.diagonal().clamp_min(0).sqrt()
    outer = norm[:, None] * norm[None, :]
    return torch.where(outer > 0, gram / outer.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(gram))


def _chunks(layout: FlatLayout, chunk: int | None):  # noqa: ANN202 - a generator of (tensor index, start, end)
    """(tensor index, start, end) in flat coordinates: each tensor in steps of ``chunk`` (whole when None)."""
    o = layout.offsets
    for i in range(len(layout.names)):
        step = chunk or max(1, o[i + 1] - o[i])
        for a in range(o[i], o[i + 1], step):
            yield i, a, min(a + step, o[i + 1])
