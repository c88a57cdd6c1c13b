"""Every constant of the goodput simulator, typed and documented in one place.

The defaults are the calibrated set described in docs/simulator.md: the data-parallel recovery
constants were chosen (within the range public reports give) so that the two data-parallel rows of
the paper's table match, and the Decoupled DiLoCo rows are then run with the very same constants."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ddiloco.platform.config import GraceConfig, QuorumConfig
from ddiloco.synchronizer.policy import GracePolicy, QuorumPolicy

Regime = Literal["dp", "dp_elastic", "diloco_sync", "decoupled"]
REGIMES: tuple[Regime, ...] = ("dp", "dp_elastic", "diloco_sync", "decoupled")
"""dp: one synchronous data-parallel job, restarted from its last checkpoint on every interruption;
dp_elastic: the same job, but it drops a failed slice and goes on with fewer (slice elasticity);
diloco_sync: M elastic learners that wait for each other at every outer step;
decoupled: M elastic learners that never wait, merged by the synchronizer's quorum and grace policy."""

SECONDS_PER_YEAR = 365.0 * 24 * 3600
SECONDS_PER_DAY = 24.0 * 3600


class SimulationConfig(BaseModel):
    """What the simulated cluster, its failures and its recovery cost."""

    model_config = ConfigDict(extra="forbid")

    mtbi_years: float = Field(1.0, gt=0)
    """Per-chip mean time between interruptions. Interruptions are Poisson per chip, so a group of
    n chips is interrupted at rate n / MTBI (the paper's setting is 1 year)."""
    days: float = Field(7.0, gt=0)
    """Simulated wall-clock span (the issue's 'full simulated week')."""
    seed: int = 0
    """Seed of the failure trace. Every regime and every learner count at one cluster size sees the
    same trace (common random numbers), so differences between rows are not sampling noise."""

    slice_chips: int = Field(256, ge=1)
    """Chips per slice: the failure domain and the unit of elasticity. A chip interruption takes its
    whole slice out until it is repaired or replaced. 256 chips is one TPU v5e / v6e pod."""
    repair_s: float = Field(600.0, ge=0)
    """How long an interrupted slice stays out before it (or a spare standing in for it) can rejoin.
    Only the elastic regimes feel it (as lost capacity); it also sets the physical bound."""

    restart_s: float = Field(64.0, ge=0)
    """Non-elastic data-parallel recovery: detect, tear down, reschedule on hot-spare slices,
    re-initialise and restore the last checkpoint from peer memory. Interruptions that arrive
    during a restart are absorbed by it."""
    downscale_s: float = Field(7.0, ge=0)
    """Elastic recovery: the in-process pause to drop a failed slice and restore the last in-memory
    snapshot on the survivors (no job restart, no recompilation)."""
    upscale_s: float = Field(7.0, ge=0)
    """Elastic pause to take a repaired slice back in. A slice that returns during another pause
    joins at the end of that pause for free."""

    checkpoint_s: float = Field(0.2, ge=0)
    """Blocking cost of one checkpoint/snapshot of the training state (to host or peer memory).
    Every synchronous group rolls back to its last completed snapshot when it is interrupted.
    0 with no interval means free, continuous snapshots (nothing is ever rolled back)."""
    checkpoint_interval_s: float | None = Field(None, gt=0)
    """Compute time between two snapshots; unset: Young's rule sqrt(2 * checkpoint_s * MTBF) with
    the MTBF of the group (MTBI / chips in the group), as an operator would tune it."""

    chip_speed_cv: float = Field(0.0, ge=0, lt=0.5)
    """Per-step speed variance: each chip's step time is 1 + cv * z, z ~ N(0, 1) independently per
    step, so a synchronous group of n chips steps at the pace of its slowest chip,
    1 + cv * E[max of n normals]. 0 (the default) turns stragglers off."""

    step_s: float = Field(5.0, gt=0)
    """Nominal inner step time (what the grace window's step-time average observes)."""
    inner_steps: int = Field(24, ge=1)
    """H: inner steps per outer round; one outer update per learner per H steps (P = H = 24 in the
    paper). A round is H * step_s of compute at full capacity."""
    outer_sync_s: float = Field(0.0, ge=0)
    """Blocking time of the outer all-reduce in synchronous DiLoCo, and the merge time the
    decoupled synchronizer reports to its grace-window average. 0 isolates failure effects."""

    quorum: QuorumConfig = Field(default_factory=QuorumConfig)
    """The synchronizer's minimum quorum K (a count, or a fraction of live learners)."""
    grace: GraceConfig = Field(default_factory=GraceConfig)
    """The synchronizer's adaptive grace window (gamma, bounds, moving-average smoothing)."""
    overlap_steps: int = Field(2, ge=0)
    """tau: steps a learner runs past a send, the budget the grace window is carved from."""

    @property
    def horizon_s(self) -> float:
        return self.days * SECONDS_PER_DAY

    @property
    def mtbi_s(self) -> float:
        return self.mtbi_years * SECONDS_PER_YEAR

    @property
    def round_s(self) -> float:
        return self.inner_steps * self.step_s

    def quorum_policy(self) -> QuorumPolicy:
        return QuorumPolicy(min_count=self.quorum.min_count, min_fraction=self.quorum.min_fraction)

    def grace_policy(self) -> GracePolicy:
        return GracePolicy(
            enabled=self.grace.enabled,
            gamma=self.grace.gamma,
            overlap_steps=self.overlap_steps,
            min_s=self.grace.min_s,
            max_s=self.grace.max_s,
        )
