"""The ``hf_vision_language`` splitter on one process: units, every cut, the media seam, loading.

Stages run in sequence here, called as the runtime calls them (stage 0 with the microbatch dict,
each later one with the previous stage's outputs), and must give the unsplit model's loss and
every gradient - for every place the single cut of a two-stage split can fall, in each family.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from pp_core import ConfigError, PipelineConfig  # noqa: E402
from pp_core.planning.parts import build_model_parts  # noqa: E402
from pp_core.planning.split import plan_split  # noqa: E402
from pp_core.runtime.microbatch import kwargs_chunk_dims, split_microbatches  # noqa: E402
from pp_core.testing import plugins_with  # noqa: E402
from pp_core_builtins.transformers import causal_lm_loss, hf_image_text_to_text  # noqa: E402
from pp_core_builtins.transformers.vision_layout import find_vision_layout  # noqa: E402
from tests.cases.vlm import SIGLIP, batch, reference_step, tiny_config, tiny_vlm  # noqa: E402

PLUGINS = plugins_with("pp_core_builtins.splitters.fqn", "pp_core_builtins.splitters.layers",
                       "pp_core_builtins.transformers")
FAMILIES = ["llava", "llava_next", "qwen2_vl"]


def _chain(parts, inputs):
    out = parts[0](**inputs)
    for part in parts[1:]:
        out = part(*out) if isinstance(out, tuple) else part(out)
    return out


def _parts(model, stages):
    config = PipelineConfig(module_fqns_per_model_part=stages)
    plan = plan_split(model, config, len(stages), 1, PLUGINS)
    return plan, build_model_parts(model, plan, range(plan.num_stages), config)


def test_units_put_the_vision_half_before_the_text_embedding():
    layout = find_vision_layout(tiny_vlm("llava"))
    assert layout.units()[:6] == [
        ("model.vision_tower.embeddings", "model.vision_tower.pre_layrnorm"),
        ("model.vision_tower.encoder.layers.0",), ("model.vision_tower.encoder.layers.1",),
        # vision_feature_layer -2: the last block never runs; it stays with the projector
        ("model.vision_tower.encoder.layers.2", "model.vision_tower.post_layernorm",
         "model.multi_modal_projector"),
        ("model.language_model.embed_tokens",), ("model.language_model.layers.0",)]
    assert layout.units()[-1] == ("model.language_model.norm", "lm_head")
    qwen = find_vision_layout(tiny_vlm("qwen2_vl")).units()
    assert qwen[:5] == [("model.visual.patch_embed",), ("model.visual.blocks.0",),
                        ("model.visual.blocks.1",), ("model.visual.blocks.2",),
                        ("model.visual.merger",)]
    next_projector = find_vision_layout(tiny_vlm("llava_next")).units()[3]
    assert next_projector[-2:] == ("model.multi_modal_projector", "model.image_newline")


@pytest.mark.parametrize("family", FAMILIES + ["llava_siglip"])
def test_every_cut_gives_the_unsplit_loss_and_gradients(family):
    extra = {"vision_config": SIGLIP, "vision_feature_select_strategy": "full"} \
        if family == "llava_siglip" else {}
    family = family.removesuffix("_siglip")
    reference = tiny_vlm(family, **extra)
    inputs, labels = batch(family, images=(2, 0, 1, 3))
    expected, grads = reference_step(reference, inputs, labels)
    layout = find_vision_layout(reference)
    units, projector = layout.units(), layout.kinds().index("projector")
    # after the front, inside the tower, before and after the projector, after the embedding,
    # inside the decoder
    for cut in (1, 2, projector, projector + 1, projector + 2, len(units) - 2):
        model = copy.deepcopy(reference)
        _, parts = _parts(model, [[f for u in units[:cut] for f in u],
                                  [f for u in units[cut:] for f in u]])
        loss = causal_lm_loss(_chain(parts, inputs), labels)
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6, msg=f"cut {cut}")
        got = {n: p.grad for part in parts for n, p in part.named_parameters()
               if p.grad is not None}
        assert got.keys() == grads.keys(), f"cut {cut}: {sorted(got.keys() ^ grads.keys())[:3]}"
        for name, grad in grads.items():
            torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=f"{cut} {name}")


def test_the_default_split_is_the_anchors_vision_on_stage_zero():
    plan = plan_split(tiny_vlm("qwen2_vl"), PipelineConfig(), 2, 1, PLUGINS)
    assert plan.splitter == "hf_vision_language"
    assert plan.fqns_per_stage[0][:3] == ["model.visual", "model.language_model.embed_tokens",
                                          "model.language_model.layers.0"]
    assert "model.visual" not in plan.fqns_per_stage[1]


def test_a_microbatch_without_images_runs_no_vision_work():
    model = tiny_vlm("llava")
    units = find_vision_layout(model).units()
    _, parts = _parts(model, [[f for u in units[:3] for f in u], [f for u in units[3:] for f in u]])
    inputs, _ = batch("llava", images=(0, 0))
    calls = []
    for layer in model.model.vision_tower.encoder.layers:
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    state, *_ = parts[0](**inputs)
    assert not calls and state.shape[0] == 0 and not state.requires_grad


@pytest.mark.parametrize("family", FAMILIES)
def test_media_are_cut_by_the_sample_they_belong_to(family):
    model = tiny_vlm(family)
    images = (2, 0, 3, 1)
    inputs, _ = batch(family, images)
    dims = kwargs_chunk_dims(model, inputs)
    assert dims.keys() == set(model.pp_vision_family.media_keys) & set(inputs)
    pieces = split_microbatches(inputs, 4, 4, "inputs", dims)
    for sample, (piece, count) in enumerate(zip(pieces, images)):
        alone, _ = batch(family, images, seed=1)  # the same batch: its own sample's rows
        owners = dims["pixel_values"]
        assert torch.equal(piece["pixel_values"], alone["pixel_values"][owners == sample])
        media = model.pp_vision_family.media(piece)
        assert media.shape[0] == (count if family != "llava" else 0)


def test_placeholders_that_images_do_not_fill_are_refused():
    model = tiny_vlm("llava")
    inputs, _ = batch("llava", (1, 2))
    inputs["pixel_values"] = inputs["pixel_values"][:2]
    with pytest.raises(ConfigError, match=r"sample 1 of the batch holds 8 image placeholder "
                                          r"tokens but its images fill 4"):
        kwargs_chunk_dims(model, inputs)


def test_stages_out_of_unit_order_or_a_unit_cut_in_two_are_refused():
    model = tiny_vlm("llava")
    units = find_vision_layout(model).units()
    rest = [f for u in units[2:] for f in u]
    with pytest.raises(ConfigError, match="holds part of the unit"):
        _parts(model, [["model.vision_tower.embeddings"],
                       ["model.vision_tower.pre_layrnorm", *units[1], *rest]])
    with pytest.raises(ConfigError, match="stages follow the model's units in order"):
        _parts(model, [[*units[1], *rest], list(units[0])])


def test_each_stage_loads_its_own_tensors_from_a_save_pretrained_directory(tmp_path):
    reference = tiny_vlm("llava_next", seed=3)
    reference.save_pretrained(tmp_path)
    inputs, labels = batch("llava_next", (1, 2))
    expected = causal_lm_loss(reference(**inputs).logits, labels)
    units = find_vision_layout(reference).units()
    stages = [[f for u in units[:4] for f in u], [f for u in units[4:] for f in u]]
    parts = []
    for stage in range(2):  # each "rank" builds its own meta model and its own stage
        model = hf_image_text_to_text(str(tmp_path), attn_implementation="eager")
        assert all(p.is_meta for p in model.parameters())
        config = PipelineConfig(module_fqns_per_model_part=stages)
        plan = plan_split(model, config, 2, 1, PLUGINS)
        parts += build_model_parts(model, plan, [stage], config, device="cpu")
    torch.testing.assert_close(causal_lm_loss(_chain(parts, inputs), labels), expected,
                               rtol=0, atol=1e-6)


def test_the_families_configs_are_the_ones_the_docs_name():
    for family in FAMILIES:
        assert tiny_config(family)["model_type"] == family


def test_static_shapes_are_refused_where_the_vision_carry_crosses_stages():
    model = tiny_vlm("llava")
    units = find_vision_layout(model).units()
    stages = [list(units[0]), [f for u in units[1:] for f in u]]
    config = PipelineConfig(module_fqns_per_model_part=stages, pp_seq_len=32)
    with pytest.raises(ConfigError, match="pipeline.pp_seq_len=32 fixes the shapes"):
        plan_split(model, config, 2, 1, PLUGINS)
    plan_split(model, PipelineConfig(pp_seq_len=32), 2, 1, PLUGINS)  # vision on stage 0: fine


def test_given_3d_rotary_positions_are_cut_on_their_batch_dim():
    model = tiny_vlm("qwen2_vl")
    inputs, labels = batch("qwen2_vl", (1, 0, 2, 1))
    positions = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                           inputs["image_grid_thw"],
                                           attention_mask=inputs["attention_mask"])[0]
    expected = causal_lm_loss(model(**inputs).logits, labels)
    pieces = split_microbatches({**inputs, "position_ids": positions}, 2, 4, "inputs",
                                kwargs_chunk_dims(model, {**inputs, "position_ids": positions}))
    assert [tuple(p["position_ids"].shape) for p in pieces] == [(3, 2, positions.shape[-1])] * 2
    units = find_vision_layout(model).units()
    _, parts = _parts(model, [[f for u in units[:3] for f in u], [f for u in units[3:] for f in u]])
    count = (labels[:, 1:] != -100).sum()
    total = sum(causal_lm_loss(_chain(parts, piece), part_labels, num_valid_tokens=count)
                for piece, part_labels in zip(pieces, labels.chunk(2)))
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-6)
