"""The ZeRO stages as a type: what each stage partitions over the data-parallel ranks, asked
by name instead of by comparing ``zero.stage`` to an int.

ZeRO §5 adds one partitioning per stage, each on top of the last: stage 1 partitions the
optimizer states (P_os, §5.1), stage 2 the gradients too (P_os+g, §5.2), stage 3 the
parameters too (P_os+g+p, §5.3); stage 0 partitions nothing (plain data parallelism, the
baseline every stage is checked against). ``config.zero.stage`` stays the user's int;
:meth:`ZeroStage.of` turns it into this type once, and runtime code asks the questions below.
"""
from __future__ import annotations

import enum


class GradientReduction(enum.Enum):
    """How one unit's gradient bucket is reduced over the data-parallel ranks (ZeRO §5.2)."""

    ALL_REDUCE = "all-reduce"
    """Stage 0: every rank keeps the whole averaged gradient (data parallelism)."""
    SCATTER_IN_PLACE = "reduce-scatter in place"
    """Stage 1: each rank keeps the full gradient buffer, accumulates in it, and at the
    accumulation boundary reduce-scatters it; its shard is its own chunk of that buffer."""
    SCATTER_INTO_SHARD = "reduce-scatter into the shard"
    """Stages 2-3: each micro-batch's bucket is reduce-scattered and added into the rank's
    gradient shard (P_g: no rank holds a full gradient after its reduction)."""


class ZeroStage(enum.Enum):
    """One ZeRO stage (ZeRO §5); its value is the user's ``zero.stage``."""

    DATA_PARALLEL = 0
    OPTIMIZER_STATES = 1
    GRADIENTS = 2
    PARAMETERS = 3

    @classmethod
    def of(cls, config) -> "ZeroStage":
        """The stage of a Config (validated: zero.stage is one of 0-3)."""
        return cls(config.zero.stage)

    @property
    def partitions_optimizer_states(self) -> bool:
        """P_os (§5.1): fp32 masters and optimizer states are split over the data-parallel
        ranks, each updating its own shard (stages 1-3)."""
        return self.value >= 1

    @property
    def partitions_gradients(self) -> bool:
        """P_g (§5.2): gradients are reduce-scattered into shards as backward produces them;
        no rank keeps a full gradient buffer (stages 2-3)."""
        return self.value >= 2

    @property
    def partitions_parameters(self) -> bool:
        """P_p (§5.3): the compute parameters are split too, and each unit is gathered around
        its forward and backward (stage 3)."""
        return self is ZeroStage.PARAMETERS

    @property
    def keeps_full_gradients(self) -> bool:
        """Each rank keeps a full gradient buffer and accumulates micro-batches locally in it
        (stages 0-1: no P_g), reducing only at the accumulation boundary."""
        return not self.partitions_gradients

    @property
    def replicates_states(self) -> bool:
        """Every rank holds every master and optimizer state whole (stage 0: no P_os), so the
        full model is read from the rank's own shard and nothing is summed over dp."""
        return not self.partitions_optimizer_states

    @property
    def gradient_reduction(self) -> GradientReduction:
        """The collective that reduces a unit's gradient bucket (§5.2)."""
        if self.replicates_states:
            return GradientReduction.ALL_REDUCE
        if self.keeps_full_gradients:
            return GradientReduction.SCATTER_IN_PLACE
        return GradientReduction.SCATTER_INTO_SHARD

    def shards_over(self, dp: int) -> int:
        """The number of shards each flat unit is split into: dp under P_os, else one."""
        return dp if self.partitions_optimizer_states else 1

    @property
    def paper_name(self) -> str:
        """The stage in the paper's notation (§5): DP, P_os, P_os+g, P_os+g+p."""
        return ("DP", "P_os", "P_os+g", "P_os+g+p")[self.value]

    def __str__(self) -> str:
        return f"stage {self.value} ({self.paper_name})"
