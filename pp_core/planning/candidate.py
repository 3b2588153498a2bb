"""The plan objects the planner ranks: an :class:`Option` of the enumeration, its
:class:`Candidate` prediction (or why it cannot run), and the :class:`Ranking`
(:func:`pp_core.planning.choose.choose_plan` makes them; re-exported there)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pp_core.errors import ConfigError
from pp_core.planning.memory import RankMemory
from pp_core.planning.sizes import format_bytes

__all__ = ["Option", "Candidate", "Ranking", "label"]


@dataclass(frozen=True)
class Option:
    """One point of the enumeration, before any prediction."""

    schedule: str
    stages_per_rank: int
    microbatch_size: int
    num_microbatches: int
    seq_chunks: int = 1  # sequence slices per microbatch (pipeline.pp_seq_chunks)


@dataclass
class Candidate:
    """An :class:`Option` with its split and predictions; ``dropped`` says why it cannot run."""

    option: Option
    fqns_per_stage: list[list[str]] | None = None
    predicted_step_s: float | None = None
    bubble_ratio: float | None = None
    memory: list[RankMemory] = field(default_factory=list)
    pool: bool = False
    dropped: str | None = None
    activation_checkpointing: list[str] | None = None   # the mode per stage
    degrees: dict[str, int] = field(default_factory=dict)  # pp_size, dp_replicate, ... (YAML)
    optimizer_step_s: float = 0.0   # of predicted_step_s, the slowest rank's optimizer step

    @property
    def peak_bytes(self) -> int | None:
        return max(m.total(self.pool) for m in self.memory) if self.memory else None

    def to_dict(self) -> dict[str, Any]:
        o = self.option
        return {"schedule": o.schedule, "stages_per_rank": o.stages_per_rank,
                "microbatch_size": o.microbatch_size, "num_microbatches": o.num_microbatches,
                "seq_chunks": o.seq_chunks,
                "predicted_step_s": self.predicted_step_s, "bubble_ratio": self.bubble_ratio,
                "optimizer_step_s": self.optimizer_step_s,
                "peak_bytes": self.peak_bytes, "recv_buffer_pool": self.pool,
                "memory_per_rank": [m.to_dict(self.pool) for m in self.memory],
                "fqns_per_stage": self.fqns_per_stage, "dropped": self.dropped,
                "activation_checkpointing": self.stage_modes(), **self.degrees}

    def stage_modes(self) -> list[str] | None:
        """The activation-checkpointing mode of each stage (``none`` when not planned)."""
        if self.activation_checkpointing is not None:
            return list(self.activation_checkpointing)
        return None if self.fqns_per_stage is None else ["none"] * len(self.fqns_per_stage)


@dataclass
class Ranking:
    """What :func:`choose_plan` decided: ``kept`` fastest first, ``dropped`` with reasons."""

    kept: list[Candidate]
    dropped: list[Candidate]
    memory_cap: int | None
    planning_s: float
    pp_size: int
    pp_batch_size: int

    @property
    def chosen(self) -> Candidate:
        """The fastest plan that fits; a ConfigError saying what would fit when none does."""
        if self.kept:
            return self.kept[0]
        sized = [c for c in self.dropped if c.peak_bytes is not None]
        if sized and self.memory_cap is not None:
            least = min(sized, key=lambda c: c.peak_bytes)
            raise ConfigError(
                f"no plan fits memory_cap={format_bytes(self.memory_cap)} per rank: the smallest "
                f"predicted peak is {format_bytes(least.peak_bytes)} ({label(least)}); raise "
                f"the cap, use more pipeline ranks, or a smaller pp_batch_size")
        reasons = "; ".join(f"{label(c)}: {c.dropped}" for c in self.dropped[:3])
        raise ConfigError(f"no schedule can run {self.pp_size} ranks with pp_batch_size="
                          f"{self.pp_batch_size} ({reasons or 'no schedule installed'})")

    def gave_up(self) -> list[Candidate]:
        """The plans predicted faster than the chosen one that were dropped (usually: memory)."""
        best = self.kept[0].predicted_step_s if self.kept else float("inf")
        faster = [c for c in self.dropped
                  if c.predicted_step_s is not None and c.predicted_step_s < best]
        return sorted(faster, key=lambda c: c.predicted_step_s)

    def to_dict(self) -> dict[str, Any]:
        return {"pp_size": self.pp_size, "pp_batch_size": self.pp_batch_size,
                "memory_cap": self.memory_cap, "planning_s": self.planning_s,
                "chosen": self.kept[0].to_dict() if self.kept else None,
                "kept": [c.to_dict() for c in self.kept],
                "dropped": [c.to_dict() for c in self.dropped]}


def label(candidate: Candidate) -> str:
    """A plan's short name in messages and tie-breaks: ``1f1b v=1 mbs=2 K=4``."""
    o = candidate.option
    slices = f" K={o.seq_chunks}" if o.seq_chunks > 1 else ""
    return f"{o.schedule} v={o.stages_per_rank} mbs={o.microbatch_size}{slices}"

