"""Dataset ``tokenized_text``: a real corpus with a local tokenizer, packed or padded rows.

``tokenized_text(files, tokenizer, seq_len, pack=True, ...)`` tokenizes the corpus once into an
on-disk cache (:mod:`pp_core_builtins.models.corpus`) and yields whole-step batches
``(inputs, target)`` of ``batch_size`` rows (the global batch; the trainer gives each dp rank its
contiguous share), targets being the next tokens:

* ``pack: true`` - each epoch's documents (shuffled by ``seed`` and the epoch) are laid end to
  end and cut into rows of ``seq_len`` tokens (each row reads ``seq_len + 1`` tokens, the last
  one only as a target). ``inputs`` is ``{"input_ids", "position_ids"}``: the position ids
  restart at 0 where a document starts (and at the row's start), which is how a row carries its
  document boundaries - the demo ``gpt`` and the HF decoders attend causally within a document
  and never across (docs/data.md). A target that belongs to another document than its input
  token is ``-100``.
* ``pack: false`` - one document per row, cut to ``seq_len + 1`` tokens, padded on the right
  with the tokenizer's pad id (0 without one); ``inputs`` is the ``[batch, seq_len]`` ids,
  padded targets are ``-100``.

Batch ``i`` depends only on ``(seed, i)`` and the corpus, so ``skip(n)`` is free and a resumed
run sees exactly the batches the uninterrupted run would have seen (mid-epoch included);
``start: N`` begins the stream at batch ``N`` (a run started from another run's export carries no
data position), as in the other built-in datasets.
``split: eval`` reads ``eval_files`` when given, else the last ``eval_fraction`` of the
documents (which ``split: train`` then leaves out).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np
import torch

from pp_core_builtins.models.arg_types import check_arg_types
from pp_core_builtins.models.datasets import BatchStream
from pp_core_builtins.models.token_cache import open_cache
from pp_core_builtins.models.corpus import load_tokenizer

__all__ = ["TokenizedText", "tokenized_text", "default_cache_dir"]


def default_cache_dir() -> str:
    """``$PP_CORE_CACHE_DIR/tokenized``, else ``~/.cache/pp-core/tokenized``."""
    base = os.environ.get("PP_CORE_CACHE_DIR") or os.path.join("~", ".cache", "pp-core")
    return os.path.join(base, "tokenized")


def _special(setting, found: Optional[int], name: str, tokenizer: str) -> Optional[int]:
    if setting in ("auto", None):
        return found
    if setting is False:
        return None
    if setting is True:
        if found is None:
            raise ValueError(f"tokenized_text: {name}: true, but tokenizer {tokenizer!r} has no "
                             f"{name.upper()} token; set {name}: false or a token id")
        return found
    if isinstance(setting, int) and not isinstance(setting, bool):
        return setting
    raise ValueError(f"tokenized_text: {name}={setting!r} must be 'auto', true, false or a "
                     f"token id")


class TokenizedText(BatchStream):
    """An endless, deterministic stream of whole-step batches over a tokenized corpus (batch
    ``i`` depends only on ``(seed, i)``: ``skip`` and iteration are :class:`BatchStream`'s)."""

    def __init__(self, files, tokenizer: str = "bytes", seq_len: int = 64, pack: bool = True,
                 batch_size: int = 8, seed: int = 0, shuffle: bool = True,
                 split: str = "train", eval_fraction: float = 0.0, eval_files=None,
                 text_field: str = "text", doc_separator: Optional[str] = "\n\n",
                 hf_split: str = "train", bos="auto", eos="auto", pad_id: Optional[int] = None,
                 cache_dir: Optional[str] = None, num_batches: Optional[int] = None,
                 start: int = 0):
        check_arg_types("tokenized_text", TokenizedText.__init__, locals())
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"tokenized_text: seq_len={seq_len!r} must be a positive int")
        if split not in ("train", "eval"):
            raise ValueError(f"tokenized_text: split={split!r} must be 'train' or 'eval'")
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"tokenized_text: eval_fraction={eval_fraction!r} must be in [0, 1)")
        if split == "eval" and eval_files is None and eval_fraction == 0.0:
            raise ValueError("tokenized_text: split: eval needs eval_files or an eval_fraction "
                             "> 0 (the last fraction of the documents, left out of training)")
        if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, int)
                                   or pad_id < 0):
            raise ValueError(f"tokenized_text: pad_id={pad_id!r} must be a token id >= 0")
        super().__init__(batch_size, seed, num_batches, start)
        self.seq_len, self.pack, self.shuffle = seq_len, bool(pack), bool(shuffle)
        self.tokenizer = load_tokenizer(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size
        """The tokenizer's vocabulary size: a model with a smaller one cannot take its ids."""
        bos_id = _special(bos, self.tokenizer.bos_id, "bos", tokenizer)
        eos_id = _special(eos, self.tokenizer.eos_id, "eos", tokenizer)
        if bos_id is not None and bos_id == eos_id and bos == "auto":
            bos_id = None  # one token for both (GPT-2 style): the EOS between documents suffices
        self.pad_id = pad_id if pad_id is not None else (self.tokenizer.pad_id or 0)
        reading = {"text_field": text_field, "doc_separator": doc_separator, "hf_split": hf_split}
        use_eval_files = split == "eval" and eval_files is not None
        self.cache = open_cache(eval_files if use_eval_files else files, self.tokenizer,
                                cache_dir or default_cache_dir(), reading, bos_id, eos_id)
        docs = np.arange(self.cache.num_docs)
        if not use_eval_files and eval_fraction > 0:
            cut = self.cache.num_docs - max(1, math.ceil(eval_fraction * self.cache.num_docs))
            docs = docs[cut:] if split == "eval" else docs[:cut]
        lengths = self.cache.offsets[docs + 1] - self.cache.offsets[docs]
        self.docs = docs[lengths >= 2]  # a document of one token has no target
        if not len(self.docs):
            raise ValueError(f"tokenized_text: the {split} split has no document of 2 tokens or "
                             f"more; check data.args.files (and eval_fraction)")
        self.total_tokens = int((self.cache.offsets[self.docs + 1]
                                 - self.cache.offsets[self.docs]).sum())
        self.rows_per_epoch = (self.total_tokens - 1) // seq_len if self.pack else len(self.docs)
        if self.rows_per_epoch < 1:
            raise ValueError(f"tokenized_text: the {split} split has {self.total_tokens} tokens, "
                             f"fewer than seq_len + 1 = {seq_len + 1}; lower seq_len or add text")
        self.max_token_id = int(self.cache.meta.get("max_token_id", -1))
        """The corpus's largest token id (from the cache's metadata): validate checks it against
        the model's vocabulary, not only batch 0's ids."""
        self._epoch: Optional[tuple[int, np.ndarray, np.ndarray]] = None

    # ------------------------------------------------------------------ order
    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's documents in order, and their start offsets in the packed stream."""
        if self._epoch is None or self._epoch[0] != epoch:
            docs = self.docs
            if self.shuffle:
                docs = np.random.default_rng([self.seed, epoch]).permutation(docs)
            lengths = self.cache.offsets[docs + 1] - self.cache.offsets[docs]
            starts = np.concatenate([[0], np.cumsum(lengths)])
            self._epoch = (epoch, docs, starts)
        return self._epoch[1], self._epoch[2]

    def _packed_row(self, epoch: int, row: int):
        docs, starts = self._order(epoch)
        begin, end = row * self.seq_len, row * self.seq_len + self.seq_len + 1
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        tokens = np.empty(end - begin, dtype=np.int64)
        doc_of = np.empty(end - begin, dtype=np.int64)
        position = np.empty(end - begin, dtype=np.int64)
        at, index = begin, first
        while at < end:
            doc_start, doc_end = int(starts[index]), int(starts[index + 1])
            take = min(end, doc_end) - at
            source = self.cache.document(int(docs[index]))
            tokens[at - begin:at - begin + take] = source[at - doc_start:at - doc_start + take]
            doc_of[at - begin:at - begin + take] = index
            position[at - begin:at - begin + take] = np.arange(take)
            at, index = at + take, index + 1
        target = tokens[1:].copy()
        target[doc_of[1:] != doc_of[:-1]] = -100  # never predict across a document boundary
        return tokens[:-1], position[:-1], target

    def _padded_row(self, epoch: int, row: int):
        docs, _ = self._order(epoch)
        source = np.asarray(self.cache.document(int(docs[row]))[: self.seq_len + 1],
                            dtype=np.int64)
        tokens = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        tokens[: len(source)] = source
        target = tokens[1:].copy()
        target[len(source) - 1:] = -100
        return tokens[:-1], target

    # ------------------------------------------------------------------ batches
    def batch(self, index: int):
        """Batch ``index`` (0-based) of the endless stream."""
        rows = [divmod(index * self.batch_size + k, self.rows_per_epoch)
                for k in range(self.batch_size)]
        if self.pack:
            made = [self._packed_row(epoch, row) for epoch, row in rows]
            ids, positions, target = (torch.from_numpy(np.stack(x)) for x in zip(*made))
            return {"input_ids": ids, "position_ids": positions}, target
        made = [self._padded_row(epoch, row) for epoch, row in rows]
        ids, target = (torch.from_numpy(np.stack(x)) for x in zip(*made))
        return ids, target


def tokenized_text(files, tokenizer: str = "bytes", seq_len: int = 64, pack: bool = True,
                   **kwargs) -> TokenizedText:
    """Dataset ``tokenized_text`` (args in docs/yaml.md)."""
    return TokenizedText(files, tokenizer, seq_len, pack, **kwargs)


# relative to the pipeline file (pp_core.app.spec.paths); "bytes" is a tokenizer, not a path
tokenized_text.pp_path_args = {"files": (), "eval_files": (), "tokenizer": ("bytes",),
                               "cache_dir": ()}
