"""How often a learner sends each fragment, and with which codec: chosen from what its link delivers.

A learner measures its link (:class:`LinkRates`: bytes/s of the uploads and downloads it completed and
the share of the recent wall time they took) and :func:`choose_cadence` picks, from a ladder of
choices in order of preference, the first that keeps its link within ``target`` at its step time: the
period H with ``compression.codec``, then with each cheaper codec down to
``fragments.adaptive_min_codec``, then 2H with each codec, 3H, … up to ``fragments.adaptive_max_periods``
H. Every fragment gets the same period (fragments are of near-equal bytes). A pure function of (now,
measurements, queue, step time, the current choice, policy) that returns its reason, like the
synchronizer's policies: tests move time by editing numbers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

MIN_WINDOW_S = 5.0
"""Shortest window the link's rates are measured over (seconds of the learner's clock)."""
WEIGH_EVERY_S = 0.1
"""The least time between two weighings of a learner's cadence: what they read is measured over MIN_WINDOW_S or more,
so a learner whose steps take milliseconds weighs it every few steps, not at each (measuring the link and weighing
the ladder took 40-80 us of the training thread a step on a CPU)."""
SATURATED = 0.95
"""A busy share at least this high says the link is saturated: what it was asked to carry is unknown,
at least this share, so the measured share is taken as half of it (as TCP halves its window)."""


@dataclass(frozen=True)
class LinkRates:
    """What a learner's link delivered over a recent window."""

    up_bps: float | None
    """Bytes per second of the uploads completed in the window, while they ran (None: none completed yet)."""
    down_bps: float | None
    """The same for downloads of global versions."""
    up_busy: float
    """Share of the window spent uploading (0..1)."""
    down_busy: float
    """Share of the window spent downloading (0..1)."""
    window_s: float


@dataclass(frozen=True)
class QueueState:
    """The upload queue as :meth:`~ddiloco.learner_worker.outbox.Outbox.queue_state` reads it."""

    depth: int
    """Fragments with an increment waiting to be uploaded."""
    oldest_unsent_s: float
    """How long the oldest of them has waited."""


@dataclass(frozen=True)
class Cadence:
    """A learner's choice: each fragment is sent every ``every`` inner steps, encoded with ``codec``."""

    every: int
    codec: str
    reason: str
    since: float
    """When it was chosen (the learner's clock)."""


@dataclass(frozen=True)
class CadencePolicy:
    """What a learner may choose from, and how readily it changes."""

    period: int
    """H: the shortest send period of a fragment, in inner steps."""
    fragments: int
    """P: the learner's fragments."""
    codecs: tuple[str, ...]
    """Codecs it may use, most precise first (the run's codec first)."""
    fragment_bytes: tuple[float, ...]
    """Encoded bytes of a mean fragment with each of ``codecs``."""
    max_periods: int = 4
    """The longest send period, in periods H."""
    target: float = 0.7
    """Share of the link a choice may plan to use (the rest absorbs bursts and measurement error)."""
    relax: float = 0.35
    """A dearer choice is taken back only when it would use less than this share: no flapping."""
    hold_periods: float = 1.0
    """A choice is kept at least this many of its own send periods (every fragment sent once), so that
    measurements of it come in; its link is measured over as long."""

    def __post_init__(self) -> None:
        if not self.codecs or len(self.codecs) != len(self.fragment_bytes):
            raise ValueError("CadencePolicy needs one fragment size per codec, and at least one codec")
        if self.period < 1 or self.fragments < 1 or self.max_periods < 1 or not 0 < self.relax < self.target <= 1:
            raise ValueError(f"invalid CadencePolicy {self}")

    def ladder(self) -> list[tuple[int, str]]:
        """(every, codec) in the order they are preferred: the shortest period first, and at each period the
        most precise codec first (a cheaper codec costs less than a longer period: docs/quality.md's int4 rows)."""
        return [(k * self.period, c) for k in range(1, self.max_periods + 1) for c in self.codecs]

    def nbytes(self, codec: str) -> float:
        return self.fragment_bytes[self.codecs.index(codec)]

    def window_s(self, every: int, step_s: float) -> float:
        """How long a choice is held, and the window its link is measured over."""
        return measure_window_s(every, step_s, self.hold_periods)


def measure_window_s(every: int, step_s: float, periods: float = 1.0) -> float:
    """The window a link's rates are measured over: ``periods`` send periods, at least :data:`MIN_WINDOW_S`."""
    return max(MIN_WINDOW_S, periods * every * max(0.0, step_s))


def initial_cadence(policy: CadencePolicy, now: float, reason: str = "start: every H steps with the run's codec") -> Cadence:
    return Cadence(policy.period, policy.codecs[0], reason, now)


def upload_share(policy: CadencePolicy, every: int, codec: str, step_s: float, up_bps: float) -> float:
    """Share of the link the uploads of (every, codec) take: P fragments, each every ``every`` steps."""
    if up_bps == math.inf:
        return 0.0
    return policy.fragments * policy.nbytes(codec) / (every * step_s) / up_bps


def choose_cadence(
    now: float, rates: LinkRates, queue: QueueState, step_s: float, current: Cadence, policy: CadencePolicy
) -> Cadence:
    """The cadence to use from ``now``: ``current`` itself when it stands, else a new one saying why.

    Uploads are predicted from the measured rate (bytes per choice over the time it has); downloads
    (float32 global versions, the same whatever the codec) from their measured share of the link
    (twice it when saturated), taken to scale with the send period, as the versions a run publishes
    do when its learners send less often. A queue whose oldest increment waited longer than a send period is behind whatever the
    figures say: the first choice with half the bytes per step. A cheaper choice is taken once the current one has been held for
    its window; a dearer one only when it would use less than ``relax`` of the link."""
    ladder = policy.ladder()
    here = (current.every, current.codec)
    j = ladder.index(here) if here in ladder else 0
    if step_s <= 0 or now - current.since < policy.window_s(current.every, step_s):
        return current
    period_s = current.every * step_s
    if queue.oldest_unsent_s > period_s and j < len(ladder) - 1:
        # Behind by an unknown amount: halve the bytes per step (or take the cheapest), as TCP halves its window.
        cost = [policy.nbytes(c) / every for every, c in ladder]
        i = next((i for i in range(j + 1, len(ladder)) if cost[i] <= cost[j] / 2), len(ladder) - 1)
        return Cadence(*ladder[i], (
            f"uploads behind: the oldest unsent increment waited {queue.oldest_unsent_s:.1f} s, more than a send period "
            f"({period_s:.1f} s), {queue.depth} fragments queued: half the bytes per step"), now)
    if rates.up_bps is None:
        return current

    down_busy = rates.down_busy * (2 if rates.down_busy >= SATURATED else 1)

    def need(rung: tuple[int, str]) -> tuple[float, float]:
        up = upload_share(policy, rung[0], rung[1], step_s, rates.up_bps or math.inf)
        return up, down_busy * current.every / rung[0]

    def say(rung: tuple[int, str]) -> str:
        up, down = need(rung)
        return f"every {rung[0]} steps with {rung[1]}: uploads {up:.2f}, downloads {down:.2f} of the link"

    link = (f"({_kb(policy.nbytes(current.codec))} per fragment, uploads at {_rate(rates.up_bps)}, "
            f"downloads at {_rate(rates.down_bps)}, {step_s:.3g} s steps)")
    shares = [max(need(r)) for r in ladder]
    fits = next((i for i, s in enumerate(shares) if s <= policy.target), None)
    if fits is None:
        i = len(ladder) - 1
        if i == j:
            return current
        return Cadence(*ladder[i], f"link saturated {link}: even {say(ladder[i])}", now)
    if fits > j:
        return Cadence(*ladder[fits], f"{say(here)}, over {policy.target:g} {link}; {say(ladder[fits])}", now)
    if fits < j:
        roomy = next((i for i, s in enumerate(shares) if s <= policy.relax), None)
        if roomy is not None and roomy < j:
            return Cadence(*ladder[roomy], f"link has room {link}: {say(ladder[roomy])}, under {policy.relax:g}", now)
    return current


def link_report(cadence: Cadence, rates: LinkRates, *, adaptive: bool) -> str:
    """A learner's link as it writes it to the ledger: the measured rates and the cadence in force with its reason."""

    def num(x: float | None) -> float | None:
        return None if x is None or not math.isfinite(x) else round(x, 1)

    c, r = cadence, rates
    return json.dumps({
        "adaptive": adaptive, "every": c.every, "codec": c.codec, "reason": c.reason,
        "since": round(c.since, 3), "up_bps": num(r.up_bps), "down_bps": num(r.down_bps),
        "up_busy": round(r.up_busy, 3), "down_busy": round(r.down_busy, 3), "window_s": round(r.window_s, 1),
    }, separators=(",", ":"))


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1e3:.1f} kB"


def _rate(bps: float | None) -> str:
    if bps is None:
        return "unmeasured"
    if bps == math.inf:
        return "no measurable time"
    return f"{bps * 8 / 1e6:.3g} Mbit/s"
