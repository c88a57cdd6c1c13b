"""The failure trace: when each slice of the cluster is interrupted, drawn once per cluster size.

Vectorised over events, never over chips x time: a cluster of N chips interrupted at N / MTBI per
second has about N * T / MTBI interruptions in a span T (46k for 2.4M chips over a week), drawn as
one Poisson count, uniform times and uniform slices."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FailureTrace:
    """Effective slice interruptions of a whole cluster, sorted by time.

    An interruption of a slice that is already out (under repair) changes nothing and is dropped,
    so every event here takes one healthy slice out for ``repair_s``."""

    times: np.ndarray  # (F,) seconds, ascending
    slices: np.ndarray  # (F,) slice index in [0, n_slices)
    n_slices: int
    chips: float
    horizon_s: float
    repair_s: float

    @property
    def chips_per_slice(self) -> float:
        return self.chips / self.n_slices

    def bound(self) -> float:
        """Physical bound: share of chip-time the chips were up (not in a slice under repair)."""
        if self.horizon_s <= 0:
            return 1.0
        down = np.minimum(self.repair_s, self.horizon_s - self.times).sum()
        return float(1.0 - down / (self.n_slices * self.horizon_s))

    def split(self, groups: int) -> list[tuple[np.ndarray, int]]:
        """Per group of contiguous slices: (its failure times, its slice count)."""
        edges = np.linspace(0, self.n_slices, groups + 1).round().astype(int)
        group_of = np.searchsorted(edges, self.slices, side="right") - 1
        order = np.argsort(group_of, kind="stable")  # stable: times stay sorted inside a group
        counts = np.bincount(group_of, minlength=groups)
        parts = np.split(self.times[order], np.cumsum(counts)[:-1])
        return [(parts[g], int(edges[g + 1] - edges[g])) for g in range(groups)]


def slice_count(chips: float, slice_chips: int, learners: int = 1) -> int:
    """Slices of about ``slice_chips`` chips, at least one per learner."""
    return max(learners, int(round(chips / slice_chips)))


def draw_failures(
    chips: float, *, n_slices: int, mtbi_s: float, horizon_s: float, repair_s: float, seed: int
) -> FailureTrace:
    """Poisson interruptions per chip (rate 1 / MTBI), grouped into slice interruptions.

    The stream is seeded by (seed, chips): each cluster size has its own reproducible trace."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(round(chips))]))
    count = rng.poisson(chips * horizon_s / mtbi_s)
    times = np.sort(rng.uniform(0.0, horizon_s, size=count))
    slices = rng.integers(0, n_slices, size=count)
    return effective_failures(times, slices, n_slices=n_slices, chips=chips, horizon_s=horizon_s, repair_s=repair_s)


def effective_failures(
    times: np.ndarray, slices: np.ndarray, *, n_slices: int, chips: float, horizon_s: float, repair_s: float
) -> FailureTrace:
    """Drop interruptions of slices already under repair (times need not be sorted)."""
    times = np.asarray(times, dtype=float)
    slices = np.asarray(slices, dtype=np.int64)
    if times.shape != slices.shape:
        raise ValueError("failure times and slices must have the same length")
    if len(slices) and (slices.min() < 0 or slices.max() >= n_slices):
        raise ValueError(f"slice indices must lie in [0, {n_slices})")
    order = np.lexsort((times, slices))  # by slice, then time
    t, s = times[order], slices[order]
    keep = np.ones(len(t), dtype=bool)
    if len(t) > 1:
        close = (s[1:] == s[:-1]) & (t[1:] - t[:-1] < repair_s)
        # Rare (a second hit within one repair): settle exactly against the last kept hit.
        for i in np.flatnonzero(close) + 1:
            j = i - 1
            while not keep[j]:
                j -= 1
            keep[i] = t[i] - t[j] >= repair_s
    t, s = t[keep], s[keep]
    by_time = np.argsort(t, kind="stable")
    return FailureTrace(t[by_time], s[by_time], n_slices, float(chips), float(horizon_s), float(repair_s))
