"""Figures as people read them: three significant digits and a unit (the dashboard, log lines, ``ddiloco config``)."""

from __future__ import annotations


def _scaled(n: float, units: tuple[tuple[str, float, float], ...]) -> str | None:
    """``n`` in the largest of ``units`` (name, size, least multiple shown in it) it reaches, to three significant
    digits ('1.33M', '12.3M', '133M'); None below them all."""
    for unit, size, least in units:
        v = n / size
        if abs(v) >= least:  # what rounds to 1.00 of a unit is shown in it, never as '1000' of the one below
            return f"{v:.{2 if abs(v) < 9.995 else 1 if abs(v) < 99.95 else 0}f}{unit}"
    return None


def format_count(n: float | None) -> str:
    """Exact up to five digits, three significant digits above: 99,949 -> '99,949'; 123_456 -> '123k'; 1_327_104 ->
    '1.33M'. At most six characters: a metric tile cuts a longer value off (the exact figure goes in its help)."""
    if n is None:
        return "—"
    n = float(n)
    return _scaled(n, (("T", 1e12, 0.9995), ("B", 1e9, 0.9995), ("M", 1e6, 0.9995), ("k", 1e3, 99.95))) or f"{n:,.0f}"


def format_bytes(n: float | None) -> str:
    """Three significant digits, at most seven characters: 928_600 -> '929 kB', 1_327_104 -> '1.33 MB'."""
    if n is None:
        return "—"
    n = float(n)
    units = tuple((f" {unit}", size, 0.9995) for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)))
    return _scaled(n, units) or f"{n:.0f} B"


def format_flops(n: float) -> str:
    """FLOPs to three significant digits: 713_687_040 -> '714 MFLOP', 6e9 -> '6.00 GFLOP'."""
    units = tuple((f" {p}FLOP", size, 0.9995) for p, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)))
    return _scaled(float(n), units) or f"{n:.0f} FLOP"


def plural(n: int, thing: str, things: str | None = None) -> str:
    """'1 rank', '8 ranks', '2 micro-batches' (``things``: the plural where it is not ``thing`` + s)."""
    return f"{n:,} {thing if n == 1 else things or thing + 's'}"
