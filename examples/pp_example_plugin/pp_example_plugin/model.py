"""The example plugin's model, dataset and position-table resource (imports torch).

``PositionTable`` is the kind of resource a real model owns outside its parameters (a rotary
embedding cache, a kernel workspace): one per process, grown before each microbatch to the
number of tokens it will see. Every block names the same ``resource_key`` and ``signature``, so
pp-core prepares it once per microbatch however many blocks a rank holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ExampleMLP", "PositionTableInitializer", "position_table", "example_regression"]

_TABLES: dict[tuple, torch.Tensor] = {}


def position_table(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The shared sinusoidal table for ``dim`` (rows = positions); prepared before each microbatch."""
    key = (dim, str(torch.device(device)))
    if key not in _TABLES:
        raise RuntimeError(f"position table {key} used before prepare(); is pp-core preparing it?")
    return _TABLES[key]


@dataclass(frozen=True)
class PositionTableInitializer:
    """Grows the shared table to ``num_tokens`` rows before each microbatch."""

    dim: int
    prepare_calls = [0]  # class-level counter, for tests and curiosity

    @property
    def resource_key(self):
        return ("pp_example_plugin.position_table", self.dim)

    @property
    def signature(self):
        return ("sinusoid", self.dim)

    def prepare(self, num_tokens: int, device: torch.device) -> None:
        PositionTableInitializer.prepare_calls[0] += 1
        key = (self.dim, str(torch.device(device)))
        table = _TABLES.get(key)
        if table is not None and table.shape[0] >= num_tokens:
            return
        positions = torch.arange(max(num_tokens, 1), dtype=torch.float32, device=device)[:, None]
        freqs = torch.exp(
            torch.arange(0, self.dim, 2, dtype=torch.float32, device=device)
            * (-math.log(10000.0) / self.dim)
        )
        table = torch.zeros(positions.shape[0], self.dim, device=device)
        table[:, 0::2] = torch.sin(positions * freqs)
        table[:, 1::2] = torch.cos(positions * freqs[: self.dim // 2])
        _TABLES[key] = table


class PositionalBlock(nn.Module):
    """A residual MLP block that adds the shared position table to its input."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def pipeline_runtime_initializers(self):
        return [PositionTableInitializer(self.dim)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = position_table(self.dim, x.device)[: x.shape[-2]].to(x.dtype)
        return x + self.mlp(self.norm(x + table))


class ExampleMLP(nn.Module):
    """``[batch, seq, in_dim]`` → ``[batch, seq, out_dim]``; follows pp-core's ``layers`` contract."""

    def __init__(self, in_dim: int = 8, dim: int = 32, out_dim: int = 4, num_layers: int = 4):
        super().__init__()
        self.proj_in = nn.Linear(in_dim, dim)
        self.layers = nn.ModuleList(PositionalBlock(dim) for _ in range(num_layers))
        self.proj_out = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.proj_in is not None:
            x = self.proj_in(x)
        for layer in self.layers:
            x = layer(x)
        if self.proj_out is not None:
            x = self.proj_out(x)
        return x


def example_regression(batch_size: int = 8, seq_len: int = 6, in_dim: int = 8, out_dim: int = 4,
                       steps: int = 1000, seed: int = 0):
    """Random inputs and a fixed random linear target: ``steps`` batches of ``batch_size``."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(in_dim, out_dim, generator=generator)
    for _ in range(steps):
        x = torch.randn(batch_size, seq_len, in_dim, generator=generator)
        yield x, x @ mixing

