"""Goodput at millions of chips: a chaos simulator for data-parallel and (Decoupled) DiLoCo training.

Pure functions over a seeded failure trace; the decoupled regime is merged by the synchronizer's own
policy functions (ddiloco.synchronizer.policy). See docs/simulator.md."""

from ddiloco.simulator.config import REGIMES, Regime, SimulationConfig
from ddiloco.simulator.failures import FailureTrace, draw_failures, effective_failures
from ddiloco.simulator.regimes import RegimeResult, Row, simulate_cluster, simulate_table, trace_for

__all__ = [
    "REGIMES",
    "FailureTrace",
    "Regime",
    "RegimeResult",
    "Row",
    "SimulationConfig",
    "draw_failures",
    "effective_failures",
    "simulate_cluster",
    "simulate_table",
    "trace_for",
]
