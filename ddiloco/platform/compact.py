"""Compact downloads of global versions: each version also published as its difference from a base.

The synchronizer keeps, per fragment, a *base* C: a float32 state that every learner following the
fragment can hold bit for bit. With each version v it publishes ``delta_v = Q(P_v − C)`` (Q: the
download codec), and a learner holding C takes ``R_v = C + deq(delta_v)`` — within the codec's
one-step bound of the exact P_v, whatever happened before, because every delta targets P_v itself
and never what a learner reconstructed last time: the error cannot accumulate. This is error
feedback kept by the synchronizer: the part of P_v a delta could not carry is what the next
delta (against the same C) carries again.

Every ``every`` versions the base moves on by the same rule: ``C' = C + deq(Q(P_v − C))`` (the
*step*), so a learner holding C follows with one compact blob; C' is also written whole (float32,
the *base blob*) for learners that are new or more than one base behind. Which blobs a download
takes is chosen by :func:`plan_download`, by size.

This module is the ledger row's form and the download plan (no torch: the ledger and the dashboard read
it); the tensor arithmetic is in ``compression.py`` (``compact_version``, ``apply_encoded``); the
synchronizer's publish and the learner's link do the I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class CompactError(ValueError):
    """A compact reference in the ledger that does not parse, or a blob that does not fit its base."""


@dataclass(frozen=True)
class Ref:
    """A blob: its key, sha256 and size."""

    key: str
    sha256: str
    nbytes: int


@dataclass(frozen=True)
class CompactRef:
    """What a version offers a learner besides its full float32 blob (the ``compact_json`` column)."""

    codec: str
    base: int
    """The version the base was built at."""
    delta: Ref
    """Q(P_v − C) in ``codec``."""
    base_blob: Ref
    """C itself, float32."""
    step_from: int | None = None
    """The previous base's version, when the base moved on from one (None: built exact)."""
    step: Ref | None = None
    """Q(P_base − C_previous): what takes a learner from the previous base to this one."""
    cheaper: dict[str, Ref] = field(default_factory=dict)
    """The same delta in cheaper codecs (codec -> blob), for learners whose link holds them to a cheaper upload codec."""

    def delta_for(self, codec: str | None) -> Ref:
        """The delta in ``codec`` when the version offers it, else in the download codec."""
        return self.cheaper.get(codec or "", self.delta)

    def to_json(self) -> str:
        def ref(r: Ref | None) -> list[Any] | None:
            return None if r is None else [r.key, r.sha256, r.nbytes]

        return json.dumps({"codec": self.codec, "base": self.base, "delta": ref(self.delta), "base_blob": ref(self.base_blob),
                           "step_from": self.step_from, "step": ref(self.step),
                           **({"cheaper": {c: ref(r) for c, r in self.cheaper.items()}} if self.cheaper else {})},
                          separators=(",", ":"))

    @classmethod
    def parse(cls, raw: str | None) -> CompactRef | None:
        """The row's reference (None when the version has none); :class:`CompactError` when it is malformed."""
        if raw is None:
            return None
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise CompactError("compact reference is not a JSON object")

            def ref(x: Any, what: str) -> Ref:
                if not (isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) and isinstance(x[1], str)
                        and _whole(x[2]) and x[2] > 0):
                    raise CompactError(f"compact reference: {what} is not [key, sha256, nbytes > 0]")
                return Ref(x[0], x[1], x[2])

            codec = d.get("codec")
            if codec not in _CODECS:
                raise CompactError(f"compact reference: unknown codec {codec!r}")
            base, step_from = d.get("base"), d.get("step_from")
            if not _whole(base) or base < 0:
                raise CompactError("compact reference: base is not a version")
            if step_from is not None and (not _whole(step_from) or not 0 <= step_from < base):
                raise CompactError("compact reference: step_from is not a version before the base")
            step = None if d.get("step") is None else ref(d["step"], "step")
            if (step is None) != (step_from is None):
                raise CompactError("compact reference: step and step_from go together")
            cheaper = d.get("cheaper", {})
            if not isinstance(cheaper, dict) or not all(c in _CODECS and c != codec for c in cheaper):
                raise CompactError("compact reference: cheaper is not a map of other codecs to blobs")
            return cls(codec, base, ref(d.get("delta"), "delta"), ref(d.get("base_blob"), "base_blob"), step_from, step,
                       {c: ref(r, f"cheaper {c}") for c, r in cheaper.items()})
        except (TypeError, ValueError) as err:
            if isinstance(err, CompactError):
                raise
            raise CompactError(f"compact reference is not valid JSON: {err}") from None

    @classmethod
    def readable(cls, raw: str | None) -> CompactRef | None:
        """:meth:`parse`, with a malformed reference read as none (for cleanup and bookkeeping, which must not stop on one)."""
        try:
            return cls.parse(raw)
        except CompactError:
            return None

    def own_keys(self, version: int) -> list[str]:
        """The blobs version ``version``'s row wrote: its delta, and when it built the base, the base and the step."""
        mine = [self.delta.key, *(r.key for r in self.cheaper.values())]
        if self.base == version:
            mine += [self.base_blob.key] + ([self.step.key] if self.step is not None else [])
        return mine


def base_of(raw: str | None) -> int | None:
    """The base version a row's compact form names (None: none, or unreadable)."""
    ref = CompactRef.readable(raw)
    return None if ref is None else ref.base


_CODECS = ("bf16", "int8", "int4")
"""Download codecs (``none`` means no compact form: full float32 downloads only)."""


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def plan_download(held: int | None, ref: CompactRef | None) -> tuple[str, ...]:
    """Which blobs take a learner holding base ``held`` (None: none) to a version with compact form ``ref``:
    ``("full",)`` without one; else the delta after whatever gets the learner that version's base — nothing
    when it holds it, the step from the previous base or the base blob, whichever is fewer bytes. A learner
    without the base takes it (a full blob's bytes once) rather than the version's full blob, so that its next
    downloads are compact."""
    if ref is None:
        return ("full",)
    if held == ref.base:
        return ("delta",)
    if ref.step is not None and held == ref.step_from and ref.step.nbytes <= ref.base_blob.nbytes:
        return ("step", "delta")
    return ("base", "delta")
