"""Dataset ``image_text``: text with 0..n images per sample, through the model's own processor.

    data:
      name: image_text
      args: {files: train.jsonl, processor: ./llava-processor, seq_len: 256}

A line of a JSON-lines file (or a row of a parquet file) is ``{"text": "...", "images":
["rel/path.png", ...]}``: image paths relative to the file, the processor's image placeholder
(``<image>`` for LLaVA, ``<|image_pad|>`` for Qwen2-VL) once per image in ``text``. Each sample
goes through ``AutoProcessor.from_pretrained(processor)`` (a local directory, never downloaded),
which expands each placeholder to the image's tokens, and is padded on the right (or cut, never
through an image) to ``seq_len`` tokens. A step's batch is ``(inputs, labels)``: ``inputs`` the
processor's tensors for ``batch_size`` samples (``input_ids``, ``attention_mask``, and the media:
``pixel_values`` and ``image_sizes`` / ``image_grid_thw``, laid end to end as the processor lays
a batch; no media keys when no sample has an image), ``labels`` the input ids with ``-100`` on
padding and image tokens: the loss is on text tokens only. Samples with 0, 1 or several images mix
in a batch; the model's media seam cuts the images by sample (:mod:`.media`).

Batch ``i`` holds samples ``i * batch_size ...`` of the epoch's order (shuffled by ``seed`` and
the epoch), so ``skip(n)`` is free. Checked when built, naming the file and line: a line that is
not a record with ``text`` and ``images``, an image that is missing or not an image, more
placeholders than images or fewer; when a sample is first processed: ``seq_len`` cutting through
its image tokens.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Optional

import torch

from pp_core import ConfigError

__all__ = ["ImageText", "image_text"]

_TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def _expand(files) -> list[Path]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    if not files:
        raise ConfigError("image_text: data.args.files is empty; give JSON-lines or parquet files")
    found = []
    for pattern in map(lambda f: os.path.expanduser(str(f)), files):
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) \
            else [pattern]
        if not matches or not all(os.path.isfile(m) for m in matches):
            raise ConfigError(f"image_text: data.args.files: no file {pattern!r}; check the path "
                              f"or glob")
        found += map(Path, matches)
    return found


def _records(path: Path):
    """``(line number, record)`` of a JSON-lines or parquet file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: parquet files only

        for number, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield number, row
        return
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"image_text: {path}:{number} is not JSON ({exc.msg}); fix "
                                  f"that line") from None


def _load_processor(processor):
    from transformers import AutoProcessor  # lazy: transformers, seconds to import

    path = Path(os.path.expanduser(str(processor)))
    if not path.is_dir():
        raise ConfigError(f"image_text: data.args.processor={str(processor)!r} is not a local "
                          f"directory (nothing is downloaded); save the model's processor with "
                          f"processor.save_pretrained(DIR) and give DIR")
    loaded = AutoProcessor.from_pretrained(str(path), local_files_only=True)
    token = getattr(loaded, "image_token", None)
    if token is None or getattr(loaded, "image_processor", None) is None:
        raise ConfigError(f"image_text: data.args.processor={str(processor)!r} is a "
                          f"{type(loaded).__name__}, not an image-text processor (no image "
                          f"token); give the directory of the model's AutoProcessor")
    return loaded


class ImageText:
    """The samples of ``files`` as whole-step batches (see the module docstring)."""

    def __init__(self, files, processor, seq_len: int = 256, batch_size: int = 8,
                 seed: int = 0, shuffle: bool = True, text_field: str = "text",
                 images_field: str = "images", num_batches: Optional[int] = None):
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"image_text: data.args.{name}={value!r} must be a positive "
                                  f"int")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.shuffle, self.num_batches, self.position = bool(shuffle), num_batches, 0
        self.processor = _load_processor(processor)
        tokenizer = self.processor.tokenizer
        self.placeholder = self.processor.image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.placeholder))
        """The processor's image placeholder token: validate checks it against the model's."""
        self.vocab_size = len(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.samples = [self._sample(path, number, record, text_field, images_field)
                        for path in _expand(files) for number, record in _records(path)]
        if not self.samples:
            raise ConfigError("image_text: data.args.files hold no sample")
        self._epoch: Optional[tuple[int, torch.Tensor]] = None

    def _sample(self, path: Path, number: int, record, text_field: str, images_field: str):
        where = f"{path}:{number}"
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ConfigError(f"image_text: {where} has no text {text_field!r} (a line is "
                              f'{{"{text_field}": "...", "{images_field}": ["a.png", ...]}}); '
                              f"fix that line")
        images = record.get(images_field) or []
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            raise ConfigError(f"image_text: {where}: {images_field!r} must be a list of image "
                              f"paths relative to the file; fix that line")
        text = record[text_field]
        found = text.count(self.placeholder)
        if found != len(images):
            more = "more" if found > len(images) else "fewer"
            raise ConfigError(f"image_text: {where} has {found} image placeholders "
                              f"{self.placeholder!r} in its text but {len(images)} images "
                              f"({more} placeholders than images); put the placeholder once per "
                              f"image")
        paths = [path.parent / image for image in images]
        for image in paths:
            _check_image(image, where)
        return where, text, paths

    # ------------------------------------------------------------------ one sample
    def processed(self, index: int) -> dict:
        """Sample ``index`` through the processor, cut to ``seq_len`` (its images' pixels are
        made when a batch needs them, never kept: a corpus of images need not fit in memory)."""
        return self._process(*self.samples[index])

    def _process(self, where: str, text: str, paths: list) -> dict:
        from PIL import Image  # lazy: Pillow comes with the image processors

        images = [Image.open(p).convert("RGB") for p in paths]
        out = dict(self.processor(text=[text], images=images or None, return_tensors="pt"))
        ids = out.pop("input_ids")[0]
        image = (ids == self.image_token_id).nonzero()
        if len(ids) > self.seq_len and len(image) and int(image[-1]) >= self.seq_len:
            raise ConfigError(f"image_text: {where}: seq_len={self.seq_len} cuts through its "
                              f"image tokens (they end at token {int(image[-1]) + 1}); raise "
                              f"data.args.seq_len to at least {int(image[-1]) + 1}")
        row = {"input_ids": ids[:self.seq_len]}
        if "mm_token_type_ids" in out:  # Qwen2-VL's 3-D positions read them
            row["mm_token_type_ids"] = out["mm_token_type_ids"][0][:self.seq_len]
        row.update({key: value for key, value in out.items() if key not in _TEXT_KEYS})
        return row

    # ------------------------------------------------------------------ batches
    def batch(self, index: int):
        """Batch ``index`` (0-based) of the endless stream."""
        rows = []
        for k in range(self.batch_size):
            epoch, at = divmod(index * self.batch_size + k, len(self.samples))
            rows.append(self.processed(int(self._order(epoch)[at])))
        return _collate(rows, self.seq_len, self.pad_id, self.image_token_id)

    def _order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample order: a permutation drawn from ``(seed, epoch)`` (kept for the
        epoch), or the files' order without ``shuffle``."""
        if self._epoch is None or self._epoch[0] != epoch:
            count = len(self.samples)
            order = torch.randperm(count, generator=torch.Generator().manual_seed(
                self.seed * 1_000_003 + epoch)) if self.shuffle else torch.arange(count)
            self._epoch = (epoch, order)
        return self._epoch[1]

    def skip(self, count: int) -> None:
        """Start the next iteration ``count`` batches further on (used when resuming)."""
        self.position += count

    def __iter__(self):
        index = self.position
        while self.num_batches is None or index < self.num_batches:
            yield self.batch(index)
            index += 1


def _check_image(path: Path, where: str) -> None:
    from PIL import Image, UnidentifiedImageError  # lazy: Pillow, with the processors

    if not path.is_file():
        raise ConfigError(f"image_text: {where}: image {str(path)!r} does not exist; paths are "
                          f"relative to the file")
    try:
        with Image.open(path) as image:
            image.size  # noqa: B018 - the header is read here
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(f"image_text: {where}: {str(path)!r} is not an image Pillow can read "
                          f"({type(exc).__name__}); fix or remove it") from None


def _collate(rows: list[dict], seq_len: int, pad_id: int, image_token: int):
    """The samples' tensors as one batch: text keys padded to ``seq_len``, media laid end to
    end (LLaVA-NeXT's tiles padded to the batch's most, as its processor does)."""
    batch = len(rows)
    inputs = {"input_ids": torch.full((batch, seq_len), pad_id, dtype=torch.long),
              "attention_mask": torch.zeros((batch, seq_len), dtype=torch.long)}
    for index, row in enumerate(rows):
        length = len(row["input_ids"])
        inputs["input_ids"][index, :length] = row["input_ids"]
        inputs["attention_mask"][index, :length] = 1
        if "mm_token_type_ids" in row:
            types = inputs.setdefault("mm_token_type_ids", torch.zeros((batch, seq_len),
                                                                       dtype=torch.int32))
            types[index, :length] = row["mm_token_type_ids"]
    for key in dict.fromkeys(k for row in rows for k in row if k not in _TEXT_KEYS):
        parts = [row[key] for row in rows if key in row]
        if key == "pixel_values" and parts[0].dim() == 5:  # [images, tiles, C, H, W]
            tiles = max(p.shape[1] for p in parts)
            parts = [torch.cat([p, p.new_zeros(p.shape[0], tiles - p.shape[1], *p.shape[2:])], 1)
                     for p in parts]
        inputs[key] = torch.cat(parts)
    ids = inputs["input_ids"]
    labels = ids.masked_fill((inputs["attention_mask"] == 0) | (ids == image_token), -100)
    return inputs, labels


def image_text(files, processor, seq_len: int = 256, **kwargs) -> ImageText:
    """Dataset ``image_text`` (args in docs/yaml.md)."""
    return ImageText(files, processor, seq_len, **kwargs)


image_text.pp_path_args = ("files", "processor")  # relative to the pipeline file (pp-core run)
