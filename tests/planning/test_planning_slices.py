"""``pipeline.pp_seq_chunks: auto``: the planner chooses the sequence slices per microbatch with
the rest of the plan (pure planning, the synthetic profiles of the AC tests): under a cap no
plan of whole microbatches fits without recomputing, slices fit; with room, whole microbatches
are faster (a slice is one more action and hand-off each)."""

import dataclasses

import pytest

from pp_core import ConfigError, PipelineConfig
from pp_core.measure.plan_auto import concrete_config
from pp_core.planning.choose import choose_plan, seq_chunk_choices
from pp_core.planning.plan import plan_pipeline
from pp_core.planning.report import format_ranking

from tests.planning.test_planning_recompute import PROFILES, only

# the executor's own time per action: what makes K slices cost more than one microbatch
TIMED = {m: dataclasses.replace(p, action_overhead_s=2e-4) for m, p in PROFILES.items()}
SCHEDULES = only("1f1b", "zero_bubble")


def test_a_tight_cap_picks_slices_where_no_ac_free_plan_fits_and_a_loose_one_whole_rows():
    whole = choose_plan(TIMED, 4, 8, SCHEDULES)  # K = 1 only, no AC
    cap = int(min(c.peak_bytes for c in whole.kept) * 0.85)
    assert not choose_plan(TIMED, 4, 8, SCHEDULES, memory_cap=cap).kept
    tight = choose_plan(TIMED, 4, 8, SCHEDULES, memory_cap=cap, seq_chunks=(1, 2, 4, 8))
    chosen = tight.chosen
    assert chosen.option.seq_chunks > 1 and chosen.peak_bytes <= cap
    assert chosen.activation_checkpointing is None  # no recompute: slices made it fit
    assert chosen.to_dict()["seq_chunks"] == chosen.option.seq_chunks
    table = format_ranking(tight)
    assert "K: sequence slices per microbatch" in table and "sequence slices each" in table
    loose = choose_plan(TIMED, 4, 8, SCHEDULES, memory_cap=cap * 10, seq_chunks=(1, 2, 4, 8))
    assert loose.chosen.option.seq_chunks == 1
    config = concrete_config(PipelineConfig(pp_schedule="auto", pp_batch_size=8,
                                            pp_seq_chunks="auto"), chosen)
    assert config.pp_seq_chunks == chosen.option.seq_chunks


def test_slices_shrink_the_predicted_activations_and_cost_actions():
    one, four = (next(c for c in choose_plan(TIMED, 4, 8, only("1f1b"), seq_chunks=(k,)).kept
                      if c.option.microbatch_size == 1) for k in (1, 4))
    assert four.option.seq_chunks == 4
    assert max(m.activations for m in four.memory) < 0.6 * max(m.activations for m in one.memory)
    assert four.bubble_ratio < one.bubble_ratio


def test_which_slice_counts_auto_tries():
    assert seq_chunk_choices("auto", 12, True) == (1, 2, 4)
    assert seq_chunk_choices("auto", 64, True) == (1, 2, 4, 8)
    assert seq_chunk_choices("auto", 64, False) == (1,)  # the model or loss cannot take slices
    assert seq_chunk_choices(2, 64, False) == (2,)  # a number is kept (the run checks it)


def test_auto_left_unchosen_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as caught:
        plan_pipeline(None, PipelineConfig(pp_seq_chunks="auto"), 2)
    assert str(caught.value).startswith("pipeline.pp_seq_chunks: auto is chosen by the planner;")
    with pytest.raises(ConfigError, match=r"pp_seq_chunks='x' must be a positive int \(>= 1\) "
                                          r"or 'auto'"):
        PipelineConfig(pp_seq_chunks="x")


def test_plan_command_with_auto_slices_ranks_each_k_and_writes_the_chosen(tmp_path, capsys):
    """``pp-core plan`` on the tiny GPT (rows of 8 tokens): every K of 1, 2, 4, 8 is ranked,
    and the file ``-o`` writes (what a run of ``pp_schedule: auto`` runs) holds the chosen K."""
    import json

    import yaml

    from pp_core.app import cli
    from tests.cases.specs import tiny_gpt_spec

    path, out = tmp_path / "auto.yaml", tmp_path / "chosen.yaml"
    path.write_text(yaml.safe_dump(tiny_gpt_spec(
        pipeline={"pp_schedule": "auto", "pp_seq_chunks": "auto", "pp_microbatch_size": None},
        distributed={"device": "cpu"})))
    assert cli.main(["plan", str(path), "--json", "--no-link", "-o", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {c["seq_chunks"] for c in data["ranking"]["kept"]} == {1, 2, 4, 8}
    written = yaml.safe_load(out.read_text())["pipeline"]
    assert written.get("pp_seq_chunks", 1) == data["chosen"]["seq_chunks"]
    assert written["pp_schedule"] == data["chosen"]["schedule"]
