"""Reading a corpus and loading a local tokenizer (the cache of its token ids: ``token_cache``).

Documents come from ``.txt`` files (split into documents at ``doc_separator``, a blank line by
default; ``None``: one document per file), ``.jsonl`` files (one JSON object per line, its
``text_field``), ``.parquet`` files (the ``text_field`` column; needs pyarrow) and directories
written by Hugging Face ``datasets``' ``save_to_disk`` (needs ``datasets``). Globs are expanded
(sorted); a directory that is not a saved dataset contributes its files of those kinds.

Tokenizers are local only - nothing is downloaded: ``bytes`` (one token per UTF-8 byte, vocab
256), a ``tokenizer.json`` file or a directory holding one (HF ``tokenizers``; the directory's
``tokenizer_config.json`` names BOS/EOS), or any other directory ``transformers``'
``AutoTokenizer`` loads with ``local_files_only=True``.

The cache of token ids is :mod:`pp_core_builtins.models.token_cache`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, Optional

from pp_core.errors import install_extra

__all__ = ["expand_files", "read_documents", "load_tokenizer", "ByteTokenizer"]

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>")


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in
                                 ("dataset_info.json", "state.json", "dataset_dict.json"))


def expand_files(files) -> list[Path]:
    """``files`` (a path, a glob, or a list of them) as existing paths, in order."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    if not files:
        raise ValueError("tokenized_text: data.args.files is empty; give the corpus's files "
                         "(paths or globs of .txt, .jsonl, .parquet, or a saved HF dataset)")
    found: list[Path] = []
    for pattern in files:
        pattern = os.path.expanduser(str(pattern))
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) \
            else [pattern]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise FileNotFoundError(f"tokenized_text: data.args.files: no file {pattern!r} "
                                    f"(from {os.getcwd()!r}); check the path or glob")
        for match in map(Path, matches):
            if match.is_dir() and not _is_saved_dataset(match):
                found += sorted(p for p in match.rglob("*") if p.suffix in TEXT_SUFFIXES)
            else:
                found.append(match)
    return found


def _column(table_columns, text_field: str, where: str):
    if text_field not in table_columns:
        raise KeyError(f"tokenized_text: {where} has no text field {text_field!r} (it has "
                       f"{', '.join(map(repr, table_columns)) or 'none'}); set data.args.text_field")


def _jsonl_text(line: str, text_field: str, where: str) -> str:
    """The ``text_field`` string of one JSONL line (``where``: its file and line)."""
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"tokenized_text: {where} is not JSON "
                         f"({exc.msg.removesuffix(' at')} at column {exc.colno}); fix that line "
                         f"of data.args.files") from None
    if not isinstance(record, dict) or text_field not in record:
        _column(list(record) if isinstance(record, dict) else [], text_field, where)
    text = record[text_field]
    if not isinstance(text, str) and text is not None:
        raise ValueError(f"tokenized_text: {where}: {text_field!r} is "
                         f"{type(text).__name__} {str(json.dumps(text))[:40]}, expected a string "
                         f"(it would train on its Python repr); fix the file or "
                         f"data.args.text_field")
    return text or ""


def read_documents(path: Path, text_field: str, doc_separator: Optional[str],
                   hf_split: str) -> Iterator[str]:
    """The documents of one file or saved dataset, in order (empty ones skipped)."""
    if _is_saved_dataset(path):
        try:
            import datasets  # lazy: datasets is an optional extra
        except ImportError:
            raise ImportError(f"tokenized_text: {str(path)!r} is a saved HF dataset; reading it "
                              f"needs the datasets package: `{install_extra('data')}`") from None
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if hf_split not in data:
                raise KeyError(f"tokenized_text: {str(path)!r} has splits {list(data)}, not "
                               f"{hf_split!r}; set data.args.hf_split")
            data = data[hf_split]
        _column(data.column_names, text_field, repr(str(path)))
        yield from (text for text in data[text_field] if text)
    elif path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        parts = [text] if doc_separator is None else text.split(doc_separator)
        yield from (part.strip() for part in parts if part.strip())
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8-sig") as handle:  # a UTF-8 BOM, as CSV readers take
            for number, line in enumerate(handle, 1):
                if line.strip():
                    text = _jsonl_text(line, text_field, f"{str(path)!r} line {number}")
                    if text:
                        yield text
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as parquet  # lazy: pyarrow is an optional extra
        except ImportError:
            raise ImportError(f"tokenized_text: reading {str(path)!r} needs pyarrow "
                              f"(`{install_extra('data')}`)") from None
        schema = parquet.read_schema(path)
        _column(schema.names, text_field, repr(str(path)))
        column = parquet.read_table(path, columns=[text_field]).column(text_field)
        yield from (text for text in column.to_pylist() if text)
    else:
        raise ValueError(f"tokenized_text: {str(path)!r} is not a .txt, .jsonl or .parquet file "
                         f"or a saved HF dataset directory")


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255); no special tokens."""

    vocab_size = 256
    bos_id = eos_id = pad_id = None
    identity = "bytes"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]


class HFTokenizer:
    """A local tokenizer: a ``tokenizers.Tokenizer`` or a ``transformers`` one."""

    def __init__(self, path: Path):
        self.path = path
        config: dict = {}
        file = path if path.is_file() else path / "tokenizer.json"
        if path.is_dir() and (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        if file.is_file():
            from tokenizers import Tokenizer  # lazy: tokenizers is an optional extra

            self._fast = Tokenizer.from_file(str(file))
            self._auto = None
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            vocab = self._fast.get_vocab(with_added_tokens=True)
            self.bos_id = self._special(config.get("bos_token"), BOS_NAMES, vocab)
            self.eos_id = self._special(config.get("eos_token"), EOS_NAMES, vocab)
            self.pad_id = self._special(config.get("pad_token"), ("<pad>", "[PAD]"), vocab)
            sources = [file] + ([path / "tokenizer_config.json"] if config else [])
        else:
            try:
                from transformers import AutoTokenizer  # lazy: transformers is an optional extra
            except ImportError:
                raise ImportError(f"tokenized_text: {str(path)!r} has no tokenizer.json; loading "
                                  f"it needs transformers (`{install_extra('transformers')}`)") from None
            self._fast = None
            self._auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            self.vocab_size = len(self._auto)
            self.bos_id, self.eos_id = self._auto.bos_token_id, self._auto.eos_token_id
            self.pad_id = self._auto.pad_token_id
            sources = sorted(p for p in path.iterdir() if p.is_file())
        digest = hashlib.sha256()
        for source in sources:
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
        self.identity = digest.hexdigest()

    @staticmethod
    def _special(configured, names, vocab) -> Optional[int]:
        if isinstance(configured, dict):
            configured = configured.get("content")
        if isinstance(configured, str):
            return vocab.get(configured)
        return next((vocab[name] for name in names if name in vocab), None)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return self._auto(texts, add_special_tokens=False)["input_ids"]


def load_tokenizer(tokenizer: str):
    """``bytes``, or a local tokenizer file or directory (never downloaded)."""
    if tokenizer == "bytes":
        return ByteTokenizer()
    path = Path(os.path.expanduser(str(tokenizer)))
    if not path.exists():
        raise FileNotFoundError(
            f"tokenized_text: data.args.tokenizer={str(tokenizer)!r} is neither 'bytes' nor a "
            f"local tokenizer.json or tokenizer directory (nothing is downloaded); save one with "
            f"tokenizer.save_pretrained(DIR) and give DIR")
    return HFTokenizer(path)
