"""Dataset ``tokenized_text`` on one process: a tokenizer trained here with HF ``tokenizers`` on
the shipped text (saved to a temp dir; nothing downloaded), the cache (built once, reused, rebuilt
when a file changes), packed rows carrying their document boundaries, padded rows, exact resume
by ``skip``, the eval split, and the errors a user meets first."""

from __future__ import annotations

import json

import pytest
import torch

from pp_core_builtins.models.datasets import DEFAULT_TEXT
from pp_core_builtins.models.tokenized import tokenized_text

tokenizers = pytest.importorskip("tokenizers")


def train_tokenizer(directory, vocab_size: int = 120) -> str:
    """A byte-level BPE tokenizer with <pad>, <s>, </s>, trained on the shipped text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tokenizer.train([str(DEFAULT_TEXT)], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def make(tmp_path, tokenizer, **kwargs):
    args = dict(files=[str(DEFAULT_TEXT)], tokenizer=tokenizer, seq_len=16, batch_size=4,
                cache_dir=str(tmp_path / "cache"))
    return tokenized_text(**{**args, **kwargs})


def test_packed_rows_carry_document_boundaries(tmp_path, tokenizer_dir):
    data = make(tmp_path, tokenizer_dir)
    bos, eos = data.tokenizer.bos_id, data.tokenizer.eos_id
    assert (bos, eos) == (1, 2) and data.vocab_size == 120
    boundaries = 0
    for index in range(6):
        inputs, target = data.batch(index)
        ids, positions = inputs["input_ids"], inputs["position_ids"]
        assert ids.shape == positions.shape == target.shape == (4, 16)
        assert ids.dtype == positions.dtype == target.dtype == torch.long
        for row in range(4):
            starts = [t for t in range(1, 16) if positions[row, t] == 0]
            for t in starts:  # a document starts: it opens with BOS, the last one ended
                assert ids[row, t] == bos and ids[row, t - 1] == eos
                assert target[row, t - 1] == -100, "a target across a boundary"
                boundaries += 1
            steps = positions[row, 1:] - positions[row, :-1]
            assert ((steps == 1) | (positions[row, 1:] == 0)).all()
        # every other target is the next input token
        same = target[:, :-1] != -100
        assert torch.equal(target[:, :-1][same], ids[:, 1:][same])
    assert boundaries > 3


def test_the_cache_is_built_once_and_keyed_by_contents(tmp_path, tokenizer_dir, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("first document here\n\nsecond one, a bit longer than the first\n\nthird")
    make(tmp_path, tokenizer_dir, files=[str(corpus)], seq_len=4)
    import pp_core_builtins.models.token_cache as token_cache

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(token_cache, "_build", refuse)
    again = make(tmp_path, tokenizer_dir, files=[str(corpus)], seq_len=4)
    assert again.cache.num_docs == 3
    corpus.write_text("changed text\n\nnew document")
    with pytest.raises(AssertionError, match="tokenized again"):
        make(tmp_path, tokenizer_dir, files=[str(corpus)], seq_len=4)
    with pytest.raises(AssertionError, match="tokenized again"):  # another tokenizer
        make(tmp_path, "bytes", files=[str(corpus)], seq_len=4)


def test_padded_rows_mask_the_padding(tmp_path, tokenizer_dir):
    data = make(tmp_path, tokenizer_dir, pack=False, seq_len=64, pad_id=0, shuffle=False)
    inputs, target = data.batch(0)
    assert isinstance(inputs, torch.Tensor) and inputs.shape == (4, 64)
    lengths = data.cache.offsets[1:5] - data.cache.offsets[:4]
    for row, length in enumerate(lengths.tolist()):
        valid = min(length, 65) - 1
        assert inputs[row, 0] == data.tokenizer.bos_id
        assert (target[row, :valid] != -100).all() and (target[row, valid:] == -100).all()
    assert (target == -100).any(), "these documents are shorter than a row"


def test_skip_resumes_exactly_across_epochs(tmp_path, tokenizer_dir):
    data = make(tmp_path, "bytes", seq_len=64)
    steps = data.rows_per_epoch // 4 + 3  # past the end of the first epoch
    straight = [b for _, b in zip(range(steps), make(tmp_path, "bytes", seq_len=64))]
    data.skip(steps - 5)
    resumed = [b for _, b in zip(range(5), data)]
    for (x, y), (rx, ry) in zip(straight[-5:], resumed):
        assert torch.equal(x["input_ids"], rx["input_ids"]) and torch.equal(y, ry)
    first, second = make(tmp_path, "bytes", seq_len=64), make(tmp_path, "bytes", seq_len=64, seed=1)
    assert not torch.equal(first.batch(0)[1], second.batch(0)[1]), "the seed orders documents"


def test_start_begins_the_stream_where_an_exported_run_left_off(tmp_path, tokenizer_dir):
    """``data.args.start: N`` (docs/transformers.md, continuing from an export) begins at batch
    ``N``, as the other built-in datasets do; tokenized_text used to refuse ``start``."""
    straight = [b for _, b in zip(range(7), make(tmp_path, "bytes", seq_len=64))]
    started = [b for _, b in zip(range(2), make(tmp_path, "bytes", seq_len=64, start=5))]
    for (x, y), (sx, sy) in zip(straight[5:], started):
        assert torch.equal(x["input_ids"], sx["input_ids"]) and torch.equal(y, sy)


def test_eval_split_by_fraction_and_by_files(tmp_path, tokenizer_dir):
    train = make(tmp_path, tokenizer_dir, eval_fraction=0.2)
    held = make(tmp_path, tokenizer_dir, eval_fraction=0.2, split="eval")
    assert set(train.docs.tolist()).isdisjoint(held.docs.tolist())
    assert len(train.docs) + len(held.docs) == train.cache.num_docs
    other = tmp_path / "eval.jsonl"
    other.write_text("\n".join(json.dumps({"body": f"evaluation text number {i}"})
                               for i in range(8)))
    by_files = make(tmp_path, tokenizer_dir, split="eval", eval_files=[str(other)],
                    text_field="body", seq_len=4)
    assert by_files.cache.num_docs == 8


def test_errors_name_the_argument(tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="data.args.files: no file"):
        make(tmp_path, tokenizer_dir, files=[str(tmp_path / "missing.txt")])
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        make(tmp_path, str(tmp_path / "no-tokenizer"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(ValueError, match="holds no text"):
        make(tmp_path, tokenizer_dir, files=[str(empty)])
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"content": "hello"}) + "\n")
    with pytest.raises(KeyError, match="no text field 'text'.*'content'"):
        make(tmp_path, tokenizer_dir, files=[str(records)])
    with pytest.raises(ValueError, match="eval_files or an eval_fraction"):
        make(tmp_path, tokenizer_dir, split="eval")


def test_parquet_files(tmp_path, tokenizer_dir):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    path = tmp_path / "docs.parquet"
    parquet.write_table(pyarrow.table({"text": ["one parquet document", "and another"]}), path)
    assert make(tmp_path, tokenizer_dir, files=[str(path)], seq_len=4).cache.num_docs == 2


def test_hugging_face_datasets_saved_to_disk(tmp_path, tokenizer_dir):
    datasets = pytest.importorskip("datasets")

    texts = ["the first saved document", "a second one", "and a third"]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    stream = make(tmp_path, tokenizer_dir, files=[str(tmp_path / "saved")], seq_len=4)
    assert stream.cache.num_docs == 3
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:2]}),
                                   "test": datasets.Dataset.from_dict({"text": texts[2:]})})
    splits.save_to_disk(str(tmp_path / "splits"))
    chosen = make(tmp_path, tokenizer_dir, files=[str(tmp_path / "splits")], seq_len=4,
                  hf_split="test")
    assert chosen.cache.num_docs == 1


def test_validate_refuses_a_tokenizer_larger_than_the_model(tmp_path, tokenizer_dir, capsys):
    import yaml

    from pp_core.app import cli

    spec = {"model": {"name": "gpt", "args": {"vocab_size": 64, "dim": 16, "num_layers": 2,
                                              "num_heads": 2, "max_seq_len": 16}},
            "data": {"name": "tokenized_text",
                     "args": {"files": [str(DEFAULT_TEXT)], "tokenizer": tokenizer_dir,
                              "seq_len": 16, "cache_dir": str(tmp_path / "cache")}},
            "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": 4, "pp_microbatch_size": 1,
                         "loss_fn": "cross_entropy"},
            "distributed": {"pp_size": 2}, "train": {"steps": 1}}
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert cli.main(["validate", str(path)]) != 0
    out = capsys.readouterr()
    assert "data.args.tokenizer: the tokenizer's vocabulary has 120 tokens but the model's " \
           "embedding only 64" in out.out + out.err
    assert cli.main(["validate", str(path), "--set", "model.args.vocab_size=128"]) == 0
