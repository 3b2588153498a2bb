"""The demo datasets: ``synthetic`` (no files needed) and ``text_bytes`` (a byte-level corpus).

Each is an endless, deterministic stream of whole-step batches ``(inputs, target)`` whose leading
dimension is the global batch size (the trainer slices it per data-parallel rank). Batch ``i``
depends only on ``(seed, i)``, so ``skip(n)`` is free and a resumed run sees exactly the batches
the uninterrupted run would have seen. ``start: N`` begins the stream at batch ``N``: a run
started from another run's exported weights (``model.args.config: DIR``) carries no data position,
so this is how it sees the batches its source run would have seen next.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pp_core_builtins.models.arg_types import check_arg_types

__all__ = ["BatchStream", "SyntheticLM", "SyntheticRegression", "TextBytes", "synthetic",
           "text_bytes", "DATA_DIR", "DEFAULT_TEXT"]

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_TEXT = DATA_DIR / "public_domain.txt"


class BatchStream:
    """An endless stream of batches where batch ``i`` is ``make(generator seeded by (seed, i))``."""

    def __init__(self, batch_size: int, seed: int = 0, num_batches: int | None = None,
                 start: int = 0):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive int")
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"start={start!r} must be an int >= 0 (the first batch's index)")
        self.batch_size = batch_size
        self.seed = seed
        self.num_batches = num_batches
        self.position = start

    def make(self, generator: torch.Generator):
        raise NotImplementedError

    def batch(self, index: int):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return self.make(generator)

    def skip(self, count: int) -> None:
        """Start the next iteration ``count`` batches further on (used when resuming)."""
        self.position += count

    def __iter__(self):
        index = self.position
        while self.num_batches is None or index < self.num_batches:
            yield self.batch(index)
            index += 1


class SyntheticLM(BatchStream):
    """Token sequences from a fixed random bigram table: learnable, so the loss visibly falls.

    Each next token is drawn from the current token's row of a sparse transition table (a few
    likely successors per token), so the best achievable loss is well below ``ln(vocab_size)``.
    """

    def __init__(self, batch_size: int = 8, seq_len: int = 32, vocab_size: int = 256,
                 seed: int = 0, num_batches: int | None = None, successors: int = 4,
                 start: int = 0):
        check_arg_types("synthetic", SyntheticLM.__init__, locals())
        super().__init__(batch_size, seed, num_batches, start)
        self.seq_len, self.vocab_size = seq_len, vocab_size
        table_generator = torch.Generator().manual_seed(seed)
        self.next_tokens = torch.randint(vocab_size, (vocab_size, successors),
                                         generator=table_generator)

    def make(self, generator):
        tokens = torch.empty(self.batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (self.batch_size,), generator=generator)
        choices = torch.randint(self.next_tokens.shape[1], (self.batch_size, self.seq_len),
                                generator=generator)
        for position in range(self.seq_len):
            tokens[:, position + 1] = self.next_tokens[tokens[:, position], choices[:, position]]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class SyntheticRegression(BatchStream):
    """``x ~ N(0, 1)`` of shape ``[batch, in_dim]`` (or ``[batch, seq_len, in_dim]``), ``y = x @ M``."""

    def __init__(self, batch_size: int = 8, in_dim: int = 16, out_dim: int = 16,
                 seq_len: int | None = None, seed: int = 0, num_batches: int | None = None,
                 start: int = 0):
        check_arg_types("synthetic", SyntheticRegression.__init__, locals())
        super().__init__(batch_size, seed, num_batches, start)
        self.shape = (batch_size, in_dim) if seq_len is None else (batch_size, seq_len, in_dim)
        self.mixing = torch.randn(in_dim, out_dim, generator=torch.Generator().manual_seed(seed))

    def make(self, generator):
        x = torch.randn(self.shape, generator=generator)
        return x, x @ self.mixing


class TextBytes(BatchStream):
    """Random windows of a text file's bytes: ``inputs = bytes[i:i+S]``, ``target = bytes[i+1:i+S+1]``.

    ``split="train"`` uses the first ``1 - val_fraction`` of the file, ``split="val"`` the rest,
    so evaluation never sees training windows.
    """

    def __init__(self, path: str | None = None, batch_size: int = 8, seq_len: int = 64,
                 seed: int = 0, split: str = "train", val_fraction: float = 0.1,
                 num_batches: int | None = None):
        check_arg_types("text_bytes", TextBytes.__init__, locals())
        super().__init__(batch_size, seed, num_batches)
        file = Path(path) if path else DEFAULT_TEXT
        if not file.is_file():
            raise FileNotFoundError(f"text_bytes: no file {str(file)!r}; set data.args.path to a "
                                    f"text file, or leave it out to use the shipped text")
        data = torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8).long()
        if split not in ("train", "val"):
            raise ValueError(f"text_bytes: split={split!r} must be 'train' or 'val'")
        cut = int(len(data) * (1 - val_fraction))
        self.data = data[:cut] if split == "train" else data[cut:]
        self.seq_len = seq_len
        if len(self.data) < seq_len + 2:
            raise ValueError(f"text_bytes: the {split} split of {str(file)!r} has "
                             f"{len(self.data)} bytes, fewer than seq_len + 2 = {seq_len + 2}")

    def make(self, generator):
        starts = torch.randint(len(self.data) - self.seq_len - 1, (self.batch_size,),
                               generator=generator)
        windows = torch.stack([self.data[s: s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def synthetic(task: str = "lm", **kwargs) -> BatchStream:
    """Dataset ``synthetic``: ``task: lm`` (token sequences) or ``task: regression``."""
    if task == "lm":
        return SyntheticLM(**kwargs)
    if task == "regression":
        return SyntheticRegression(**kwargs)
    raise ValueError(f"synthetic: task={task!r} must be 'lm' or 'regression'")


def text_bytes(**kwargs) -> TextBytes:
    """Dataset ``text_bytes``: a byte-level language-modelling stream over a text file."""
    return TextBytes(**kwargs)
