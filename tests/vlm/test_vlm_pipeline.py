"""Vision-language models through ``build_pipeline`` on 4 real gloo ranks, vs one process.

Every case builds the same tiny random-weight VLM on every rank, runs one pipelined step on a
batch whose samples hold 0..3 images each (microbatches of one sample: several without any
image), and compares the loss and every gradient - the vision tower's and the projector's
included - with the unsplit model's backward over the whole batch on the same process (fp32,
1e-5). Layouts: pp2 (two pipelines side by side), pp2 x dp2 (FSDP2; each dp rank's half of the
batch cut by the media seam) and pp2 x tp2 (the decoder sharded, the tower replicated).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.ranks(4, timeout=240)

ATOL = 1e-5


def _run(pool, *args, **kwargs):
    from tests.cases.vlm import pipeline_case

    results = pool.run(pipeline_case, *args, **kwargs)
    for result in results:
        assert result["grad_err"] < ATOL, result
        if result["loss_err"] is not None:
            assert result["loss_err"] < ATOL, result
    assert any(r["loss_err"] is not None for r in results)
    return results


def _units(family):
    from tests.cases.vlm import tiny_vlm
    from pp_core_builtins.transformers.vision_layout import find_vision_layout

    return find_vision_layout(tiny_vlm(family)).units()


def _cut(family, *cuts):
    """``module_fqns_per_model_part`` cutting the model's units at ``cuts``."""
    units = _units(family)
    bounds = [0, *cuts, len(units)]
    return [[fqn for unit in units[a:b] for fqn in unit] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_vl"])
def test_pp2_1f1b_vision_on_stage_zero(pool, family):
    results = _run(pool, family, "1f1b")
    names = {name for r in results for name in r["names"]}
    assert any(".vision_tower." in n or ".visual." in n for n in names)


@pytest.mark.parametrize("schedule", ["zero_bubble", "interleaved_1f1b", "v_schedule"])
def test_pp2_schedules_with_the_encoder_on_its_own_stages(pool, schedule):
    family = "llava_next" if schedule == "v_schedule" else "llava"
    stages = 4 if schedule != "zero_bubble" else 2
    cuts = (2, 5, 8)[:stages - 1] if stages == 4 else (4,)
    _run(pool, family, schedule, fqns=_cut(family, *cuts))


def test_pp2_dp2_fsdp_cuts_images_by_sample(pool):
    _run(pool, "llava_next", "1f1b", layout="dp", fqns=_cut("llava_next", 4))


@pytest.mark.parametrize("layout, schedule", [("dp", "interleaved_1f1b"), ("dp", "v_schedule"),
                                              ("tp", "zero_bubble"), ("tp", "interleaved_1f1b"),
                                              ("tp", "v_schedule")])
def test_the_schedules_at_pp2_x_dp2_and_pp2_x_tp2(pool, layout, schedule):
    _run(pool, "llava", schedule, layout=layout)


def test_pp2_tp2_decoder_sharded_tower_replicated(pool):
    results = _run(pool, "qwen2_vl", "1f1b", layout="tp")
    sharded = {n for r in results for names in r["sharded"].values() for n in names}
    assert any(".language_model.layers." in n for n in sharded)
    assert not any(".visual." in n for n in sharded)  # its fused qkv: replicated


def test_permuted_samples_still_match(pool):
    _run(pool, "qwen2_vl", "zero_bubble", order=[7, 2, 5, 0, 3, 6, 1, 4], microbatch=2,
         fqns=_cut("qwen2_vl", 3))


def test_a_frozen_vision_tower_in_front_runs_no_backward(pool):
    freeze = ["model.vision_tower.", "model.multi_modal_projector."]
    results = _run(pool, "llava", "1f1b", fqns=_cut("llava", 4), freeze=freeze)
    stage0 = [r for r in results if 0 in r["stages"]]
    assert stage0 and all(r["actions"].get(0, 0) == 0 for r in stage0), stage0
    stage1 = [r for r in results if 1 in r["stages"]]
    assert all(r["actions"][1] > 0 for r in stage1)


def test_pp2_tp2_clip_tower_on_its_own_stage_is_sharded(pool):
    results = _run(pool, "llava", "1f1b", layout="tp", fqns=_cut("llava", 4))
    stage0 = [r["sharded"][0] for r in results if 0 in r["sharded"]]
    assert stage0 and all(any(".vision_tower.encoder.layers.0.mlp.fc1" in n for n in names)
                          for names in stage0)
