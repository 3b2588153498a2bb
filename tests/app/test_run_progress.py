"""The progress line (a bar on a terminal, plain lines otherwise) and the summary table."""

from __future__ import annotations

import io

from pp_core.app.rank.progress import Progress, format_bytes, format_duration, format_summary


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_terminal():
    stream = Terminal()
    progress = Progress(100, mode="auto", stream=stream)
    assert progress.mode == "bar"
    progress.update(25, 3.25, 12_345.6, 0.125)
    progress.message("checkpoint saved")
    progress.update(50, 2.5, 12_000, 0.1)
    progress.close()
    text = stream.getvalue()
    assert "\r[######------------------] step  25/100  loss  3.2500  12,346 tok/s  125 ms/step" \
        in text
    assert "ETA " in text and "\r\x1b[Kcheckpoint saved\n" in text and text.endswith("\n")


def test_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    progress = Progress(10, start_step=0, mode="auto", log_every=4, stream=stream)
    assert progress.mode == "plain"
    for step in range(1, 11):
        progress.update(step, None if step == 1 else 1.0, 100.0, 0.01)
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/10", "4/10", "8/10", "10/10"]
    assert "loss    n/a" in lines[0] and "\r" not in stream.getvalue()
    quiet = io.StringIO()
    Progress(10, mode="off", stream=quiet).update(1, 1.0, 1.0, 1.0)
    assert quiet.getvalue() == ""


def test_formatting_helpers():
    assert format_duration(None) == "?" and format_duration(5.25) == "5.2s"
    assert format_duration(75) == "1m15s" and format_duration(3 * 3600 + 60) == "3h01m"
    assert format_bytes(512) == "512 B" and format_bytes(3 * 1024 ** 2) == "3.0 MiB"


def test_summary_table():
    summary = {
        "source": "examples/demo.yaml", "model": "gpt", "num_params": 860_000,
        "data": "text_bytes", "schedule": "v_schedule", "pp_size": 2, "dp_size": 1,
        "num_stages": 4, "num_microbatches": 4, "first_step": 1, "last_step": 3, "wall_s": 90.0,
        "tokens_per_step": 1024, "losses": [5.5, 4.0, 2.5], "step_times": [0.3, 0.2, 0.1],
        "tokens_per_s": [3000.0, 5000.0, 10000.0], "eval_loss": 2.75,
        "bubble_note": "simulated with ...",
        "ranks": [{"rank": 0, "stages": [0, 3], "bubble_measured": 0.25, "comm_share": 0.1,
                   "bubble_simulated": 0.05, "peak_memory": 300 * 1024 ** 2,
                   "memory_kind": "process RSS"}],
        "outputs": {"metrics": "m.jsonl", "trace": None},
    }
    text = format_summary(summary)
    assert "gpt (0.86M params) on text_bytes; schedule v_schedule, pp 2 x dp 1, 4 stages" in text
    assert "loss 5.5000 -> 2.5000 (first -> last step" in text and "eval loss 2.7500" in text
    assert "throughput 7,500 tokens/s (median)" in text
    row = [line for line in text.splitlines() if line.startswith("  0 ")][0]
    assert row.split()[:6] == ["0", "0,3", "25.0%", "10.0%", "5.0%", "300.0"]
    assert "metrics: m.jsonl" in text and "trace:" not in text


def test_the_summary_says_what_each_stage_holds():
    from pp_core.app.rank.progress import compact_names

    names = ["model.vision_tower", "model.language_model.embed_tokens",
             "model.language_model.layers.0", "model.language_model.layers.1",
             "model.language_model.layers.3", "model.language_model.rotary_emb"]
    assert compact_names(names) == ("model.vision_tower, model.language_model.embed_tokens, "
                                    "model.language_model.layers.0-1, "
                                    "model.language_model.layers.3, model.language_model.rotary_emb")
