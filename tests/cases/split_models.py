"""Tiny models shared by the splitting tests (torchtitan-style, sequential, declared chains)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, h, scale):
        return h + self.mlp(torch.tanh(self.norm(h))) * scale


class TinyLM(nn.Module):
    """Meets the ``layers`` contract: skips ``None`` modules, iterates ``self.layers``."""

    def __init__(self, vocab=11, dim=8, depth=4, dict_layers=False, tied=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.dropout = nn.Identity()  # parameter-free child before `layers`
        blocks = [Block(dim) for _ in range(depth)]
        if dict_layers:
            self.layers = nn.ModuleDict({f"b{i}": block for i, block in enumerate(blocks)})
        else:
            self.layers = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if self.dropout is not None:
            h = self.dropout(h)
        blocks = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for block in blocks:
            h = block(h, self.scale)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_weights(self):
        for module in (self.tok_embeddings, self.norm, self.output):
            if module is not None:
                module.reset_parameters()
        for block in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            for sub in block.modules():
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
        self.scale.fill_(0.5)


class Chain(nn.Module):
    """Declares itself a chain: forward runs the children in registration order."""

    pp_sequential = True

    def __init__(self, dim=6, depth=5):
        super().__init__()
        for i in range(depth):
            self.add_module(f"fc{i}", nn.Linear(dim, dim))
            self.add_module(f"act{i}", nn.Tanh())

    def forward(self, x):
        for child in self.children():
            x = child(x)
        return x


def mlp(dims=(4, 8, 8, 8, 2)):
    layers = []
    for i in range(len(dims) - 1):
        layers += [nn.Linear(dims[i], dims[i + 1]), nn.ReLU()]
    return nn.Sequential(*layers[:-1])
