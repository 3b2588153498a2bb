"""Bad pipeline files are refused quickly with one bounded line, never a traceback: duplicate
keys, alias bombs, deep nesting, binary and latin-1 bytes, huge values quoted in messages."""

from __future__ import annotations

import time

import pytest

from pp_core.app import cli
from pp_core.errors import quoted
from pp_core.app.spec import SpecError, load_spec

GOOD = """\
model: {name: gpt, args: {dim: 32, num_layers: 2, num_heads: 4, max_seq_len: 16}}
data: {name: synthetic, args: {seq_len: 16}}
pipeline: {pp_batch_size: 4, loss_fn: cross_entropy}
"""

BILLION_LAUGHS = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},"
    f"*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},"
    f"*{chr(97 + i)}]\n" for i in range(8))


@pytest.mark.parametrize("content, expected", [
    (GOOD + "train: {steps: 3}\ntrain: {steps: 5}\n",
     "line 5: key 'train' is given twice in one mapping (first on line 4); keep one"),
    (GOOD.replace("dim: 32,", "dim: 32, dim: 64,"),
     "line 1: key 'dim' is given twice in one mapping (first on line 1)"),
    (BILLION_LAUGHS, "expand to more than 100,000 values"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 64 levels deep"),
    ("a: " + "{b: " * 80 + "1" + "}" * 80 + "\n", "nested more than 64 levels deep"),
    ("model:\n  name: caf\xe9\n".encode("latin-1"),
     "line 2: byte 0xe9 is not UTF-8 text; save the file as UTF-8"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "a binary file, not YAML text"),
    (GOOD + "train: {steps: " + "9" * 5000 + "}\n", "not valid YAML: Exceeds the limit"),
    ("model: {name: \"" + "x" * 100_000 + "\"\n", "not valid YAML: line"),
])
def test_bad_files_are_refused_with_one_short_line(tmp_path, capsys, content, expected):
    path = tmp_path / "pipe.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    started = time.perf_counter()
    code = cli.main(["validate", str(path)])
    elapsed = time.perf_counter() - started
    err = capsys.readouterr().err
    assert code == 1 and expected in err, err
    assert len(err) < 1500 and "Traceback" not in err, err
    assert elapsed < 20, elapsed  # was 34 s and 3 GB for the alias bomb (a guard, not a timing)


def test_aliases_that_stay_small_still_work(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text(GOOD.replace("args: {seq_len: 16}", "args: &d {seq_len: 16}, eval_args: *d"))
    assert load_spec(path).data.eval_args == {"seq_len": 16}


def test_a_merge_key_may_be_overridden_without_counting_as_a_duplicate(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text(GOOD + "train: {<<: &t {steps: 3, log_every: 1}, steps: 5}\n")
    assert load_spec(path).train.steps == 5 and load_spec(path).train.log_every == 1


def test_a_set_override_is_read_the_same_way():
    from pp_core.app.spec import parse_override

    with pytest.raises(SpecError, match="nested more than 64 levels deep"):
        parse_override("train.steps=" + "[" * 100 + "]" * 100)


def test_quoted_bounds_what_a_message_quotes():
    assert quoted("x" * 10) == repr("x" * 10)
    text = quoted("9" * 10_000_000)
    assert len(text) < 100 and "10,000,000 chars" in text
    shared = ["x"] * 1000
    for _ in range(9):  # what an alias bomb builds: 1000**10 items, a few KB of memory
        shared = [shared] * 1000
    started = time.perf_counter()
    assert len(quoted(shared)) <= 80 and time.perf_counter() - started < 5
