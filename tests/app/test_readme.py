"""The README speaks to a user and stays true: its sample run summary has the shape the summary
prints today (line by line, numbers aside), cheaply - no demo is run; it is at most 200 lines,
names the distribution to install and keeps the test command CI runs."""

from __future__ import annotations

import re
from pathlib import Path

from pp_core.app.rank.progress import format_summary
from pp_core.errors import DISTRIBUTION

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

DEMO = {  # what the demo's rank 0 returns, as far as the summary reads it
    "source": "examples/demo.yaml", "model": "gpt", "num_params": 1_880_000,
    "data": "text_bytes", "schedule": "v_schedule", "pp_size": 2, "dp_size": 1, "tp_size": 1,
    "mesh": "pp 2 x dp_replicate 1 x dp_shard 1 x tp 1", "num_stages": 4,
    "num_microbatches": 8, "first_step": 1, "last_step": 500, "wall_s": 61.0,
    "tokens_per_step": 1024, "losses": [5.61, 1.5, 1.49], "eval_loss": 2.54,
    "step_times": [0.17, 0.11, 0.12], "tokens_per_s": [6000.0, 9000.0, 8500.0],
    "valid_tokens_per_s": 8700.0, "padding_fraction": 0.0, "docs": 16.0,
    "ranks": [{"rank": r, "stages": s, "bubble_measured": 0.1, "comm_share": 0.03,
               "bubble_simulated": 0.02, "peak_memory": 360 * 2**20,
               "memory_kind": "process RSS"} for r, s in ((0, [0, 3]), (1, [1, 2]))],
    "bubble_note": "simulated with this run's mean action times in ms (stage 0: F=2.1 I=0.0 "
                   "W=2.5, stage 1: F=1.5 I=2.2 W=1.5, stage 2: F=2.3 I=1.6 W=1.3, stage 3: "
                   "F=2.2 I=2.4 W=1.5)",
    "outputs": {"metrics": "/x/runs/demo/metrics.jsonl", "trace": "/x/runs/demo/trace.json",
                "schedule image": "/x/runs/demo/schedule.svg",
                "checkpoints": "/x/runs/demo/checkpoints"},
}


def shape(line: str) -> str:
    """A line with its numbers, paths and column padding left out."""
    line = re.sub(r"/\S+", "PATH", line)
    line = re.sub(r"\d[\d,]*(\.\d+)?", "9", line)
    return re.sub(r"\s+", " ", line).strip()


def test_the_readme_sample_summary_has_the_shape_the_summary_prints():
    block = README.split("The run ends with a summary", 1)[1].split("```\n", 2)[1]
    sample = [shape(line) for line in block.splitlines()]
    printed = [shape(line) for line in format_summary(DEMO).splitlines()]
    assert sample == printed, "\n".join(f"README: {a}\nprints: {b}"
                                        for a, b in zip(sample, printed) if a != b)


def test_the_readme_is_a_users_page():
    assert len(README.splitlines()) <= 200
    assert "bash scripts/test.sh" in README  # CI runs the test command written in README.md
    assert DISTRIBUTION in README and "pip install -e ." in README
