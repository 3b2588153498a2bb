"""The ``hf_decoder`` splitter on one process: plans, parts, forwards, tied weights, loading.

Stages run in sequence here (stage ``s`` called as ``forward(*outputs of s-1)``, exactly as the
runtime calls them) and must reproduce the unsplit Hugging Face model's loss and every gradient.
The multi-process pipeline tests are in ``test_transformers_pipeline.py``.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from pp_core import ConfigError, PipelineConfig  # noqa: E402
from pp_core.planning.parts import build_model_parts  # noqa: E402
from pp_core.planning.split import plan_split  # noqa: E402
from pp_core.testing import plugins_with  # noqa: E402
from pp_core_builtins.transformers import causal_lm_loss, hf_causal_lm, sync_tied_gradients_of  # noqa: E402
from pp_core_builtins.transformers.layout import find_layout  # noqa: E402
from tests.cases.hf import (  # noqa: E402
    ARCHITECTURES, VOCAB, batch, tiny_config, tiny_model)

PLUGINS = plugins_with("pp_core_builtins.splitters.fqn", "pp_core_builtins.splitters.layers",
                       "pp_core_builtins.splitters.sequential", "pp_core_builtins.transformers")


def build(model, num_stages, config=None, num_ranks=None, stages_per_rank=1, **kw):
    config = config or PipelineConfig()
    plan = plan_split(model, config, num_ranks or num_stages, stages_per_rank, PLUGINS, **kw)
    return plan, build_model_parts(model, plan, range(plan.num_stages), config)


def run_chain(parts, inputs):
    """Stage 0 gets the microbatch (``**dict``, ``*tuple`` or a tensor), later ones ``*outs``."""
    if isinstance(inputs, dict):
        out = parts[0](**inputs)
    else:
        out = parts[0](*inputs) if isinstance(inputs, tuple) else parts[0](inputs)
    for part in parts[1:]:
        out = part(*out) if isinstance(out, tuple) else part(out)
    return out


def summed_grads(parts):
    """Every parameter's gradient by name, tied copies summed as ``sync_tied_gradients`` does."""
    sync_tied_gradients_of(parts, stage_ranks=[0] * len(parts), rank=0)
    return {name: p.grad for part in parts
            for name, p in part.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_stages_in_sequence_match_the_unsplit_model(arch):
    model_type, extra = ARCHITECTURES[arch]
    reference = tiny_model(model_type, **extra)
    model = copy.deepcopy(reference)
    inputs, labels = batch()
    expected = causal_lm_loss(reference(**inputs).logits, labels)
    expected.backward()

    plan, parts = build(model, 3)
    assert plan.splitter == "hf_decoder"
    loss = causal_lm_loss(run_chain(parts, inputs), labels)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)
    grads = summed_grads(parts)
    for name, param in reference.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=1e-5, msg=name)


def test_split_layout_of_the_docstring():
    model = tiny_model(num_layers=6)
    plan, parts = build(model, 3)
    rotary = "model.rotary_emb"
    assert plan.fqns_per_stage == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1", rotary],
        ["model.layers.2", "model.layers.3", rotary],
        ["model.layers.4", "model.layers.5", "model.norm", "lm_head", rotary],
    ]
    # layer containers with gaps keep the original keys; rotary is on every stage
    assert [list(p.model.layers._modules) for p in parts] == [["0", "1"], ["2", "3"], ["4", "5"]]
    assert all(p.model.rotary_emb is model.model.rotary_emb for p in parts)
    assert parts[1].model.embed_tokens is None and parts[1].lm_head is None
    assert [type(p).__name__ for p in parts] == ["LlamaForCausalLM"] * 3


def test_parts_keep_names_and_cover_the_model():
    model = tiny_model(tie_word_embeddings=True)
    _, parts = build(model, 2)
    keys = [set(p.state_dict()) for p in parts]
    assert set().union(*keys) == set(model.state_dict())
    assert all(k <= set(model.state_dict()) for k in keys)


def test_layers_per_stage_gives_virtual_stages_with_rounding():
    model = tiny_model(num_layers=7)
    config = PipelineConfig(pp_schedule="interleaved_1f1b", layers_per_stage=2,
                            round_virtual_stages_to_pp_multiple="down")
    plan, parts = build(model, None, config, num_ranks=3, stages_per_rank=None)
    assert (plan.num_stages, plan.stages_per_rank) == (3, 1)  # ceil(7 / 2) = 4, rounded down
    assert [len(p.model.layers) for p in parts] == [2, 3, 2]  # the extra layer goes inside
    config = PipelineConfig(pp_schedule="interleaved_1f1b", layers_per_stage=2,
                            round_virtual_stages_to_pp_multiple="up")
    plan, parts = build(model, None, config, num_ranks=2, stages_per_rank=2)
    assert plan.num_stages == 4
    assert [len(p.model.layers) for p in parts] == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="round_virtual_stages_to_pp_multiple"):
        build(model, None, PipelineConfig(layers_per_stage=2), num_ranks=3)


def test_module_fqns_per_model_part_overrides_the_split_and_still_patches():
    reference = tiny_model()
    model = copy.deepcopy(reference)
    fqns = [["model.embed_tokens", "model.layers.0"],
            ["model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head"]]
    plan, parts = build(model, 2, PipelineConfig(module_fqns_per_model_part=fqns))
    assert plan.splitter == "hf_decoder"  # priority 400 beats the generic fqn splitter (300)
    assert plan.fqns_per_stage == [stage + ["model.rotary_emb"] for stage in fqns]
    inputs, labels = batch()
    torch.testing.assert_close(run_chain(parts, inputs), reference(**inputs).logits,
                               rtol=0, atol=1e-5)


def test_padding_mask_and_positions_reach_every_stage():
    model = tiny_model()
    _, parts = build(model, 2)
    inputs, _ = batch()
    hidden, positions, mask = parts[0](**inputs)
    assert mask.dtype == torch.long and positions.dtype == torch.long
    with_mask = parts[1](hidden, positions, mask)
    without = parts[1](hidden, positions)
    padded = inputs["attention_mask"][:, 0] == 0
    assert not torch.allclose(with_mask[padded], without[padded])  # the later stage uses it
    torch.testing.assert_close(with_mask, model(**inputs).logits, rtol=0, atol=1e-5)
    shifted = parts[1](hidden, positions * 2, mask)  # and it uses the position ids it is given
    assert not torch.allclose(shifted, with_mask)


def test_first_stage_accepts_tensor_and_tuple_microbatches_without_mask():
    model = tiny_model()
    _, parts = build(model, 2)
    ids = batch(padding=False)[0]["input_ids"]
    expected = model(input_ids=ids).logits
    hidden, positions = parts[0](ids)
    torch.testing.assert_close(parts[1](hidden, positions), expected, rtol=0, atol=1e-5)
    out = run_chain(parts, (ids, torch.ones_like(ids)))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_first_stage_rejects_inputs_it_cannot_route():
    _, parts = build(tiny_model(), 2)
    inputs, labels = batch()
    with pytest.raises(TypeError, match="unexpected input 'labels'"):
        parts[0](**inputs, labels=labels)
    with pytest.raises(TypeError, match=r"hidden_states, position_ids\[, attention_mask\]"):
        parts[1](inputs["input_ids"])


def test_tied_embeddings_get_one_parameter_per_stage():
    model = tiny_model(tie_word_embeddings=True)
    _, parts = build(model, 3)
    first, last = parts[0].model.embed_tokens.weight, parts[2].lm_head.weight
    assert first is model.model.embed_tokens.weight and last is not first
    assert torch.equal(first, last)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the model stays tied
    names = ("model.embed_tokens.weight", "lm_head.weight")
    assert parts[0].pp_tied_parameters == {names[0]: names}
    assert parts[2].pp_tied_parameters == {names[1]: names}
    assert parts[2].pp_tied_stages == {names: (0, 2)}
    assert not hasattr(parts[1], "pp_tied_stages")


def test_tied_embeddings_on_one_stage_stay_shared():
    model = tiny_model(tie_word_embeddings=True)
    _, parts = build(model, 1)
    assert parts[0].lm_head.weight is parts[0].model.embed_tokens.weight
    assert parts[0].pp_tied_parameters == {}


def test_optimizer_step_keeps_tied_copies_identical():
    reference = tiny_model(tie_word_embeddings=True)
    model = copy.deepcopy(reference)
    _, parts = build(model, 2)
    inputs, labels = batch()
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(2):
        causal_lm_loss(run_chain(parts, inputs), labels).backward()
        assert sync_tied_gradients_of(parts, [0, 0], rank=0) == 1
        optimizer.step()
        optimizer.zero_grad()
        causal_lm_loss(reference(**inputs).logits, labels).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    assert torch.equal(parts[0].model.embed_tokens.weight, parts[1].lm_head.weight)
    torch.testing.assert_close(parts[1].lm_head.weight, reference.lm_head.weight,
                               rtol=0, atol=1e-5)


def test_patch_flags_off_keep_the_class_forwards():
    model = tiny_model()
    inputs, _ = batch()
    expected = model(**inputs).logits
    config = PipelineConfig(patch_inner_model=False)
    _, parts = build(model, 1, config)
    assert "forward" not in parts[0].model.__dict__ and "forward" in parts[0].__dict__
    torch.testing.assert_close(parts[0](**inputs), expected)  # wrapper unwraps the ModelOutput
    config = PipelineConfig(patch_inner_model=False, patch_causal_lm_model=False)
    _, parts = build(model, 2, config)
    assert "forward" not in parts[0].__dict__ and "forward" not in parts[0].model.__dict__
    with pytest.raises(Exception):  # the class's own forward cannot run on a partial model
        parts[0](**inputs)


def test_bare_text_model_ends_in_normalised_hidden_states():
    from transformers import AutoModel

    model = AutoModel.from_config(transformers_config(), attn_implementation="eager")
    assert find_layout(model).text == "" and find_layout(model).head is None
    inputs, _ = batch()
    _, parts = build(model, 2)
    torch.testing.assert_close(run_chain(parts, inputs), model(**inputs).last_hidden_state,
                               rtol=0, atol=1e-5)


def test_models_with_other_heads_are_refused_with_the_reason():
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_config(transformers_config())
    with pytest.raises(ConfigError, match="hf_decoder: no `lm_head`"):
        plan_split(model, PipelineConfig(), 2, 1, PLUGINS)


def transformers_config(**extra):
    from transformers import AutoConfig

    values = tiny_config(**extra)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def test_vision_language_model_text_stages():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    text = {k: v for k, v in tiny_config().items()}
    vision = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(
        LlavaConfig(text_config=text, vision_config=vision, image_token_index=VOCAB - 1))
    model.config._attn_implementation = "eager"
    plan, parts = build(model, 2)
    assert plan.fqns_per_stage[0][:3] == ["model.vision_tower", "model.multi_modal_projector",
                                          "model.language_model.embed_tokens"]
    assert plan.fqns_per_stage[1][-3:] == ["model.language_model.norm", "lm_head",
                                           "model.language_model.rotary_emb"]
    inputs, _ = batch()
    torch.testing.assert_close(run_chain(parts, inputs), model(**inputs).logits,
                               rtol=0, atol=1e-5)



@pytest.mark.parametrize("tied", [False, True])
def test_meta_model_loads_each_stage_from_a_sharded_checkpoint(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    tiny_model(tie_word_embeddings=tied, seed=7).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in weight_map) is not tied  # saved once when tied
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    inputs, labels = batch()
    expected = causal_lm_loss(reference(**inputs).logits, labels)

    parts = []
    for stage in range(3):  # each "rank" builds its own meta model and its own stage
        model = hf_causal_lm(str(tmp_path), attn_implementation="eager")
        assert all(p.is_meta for p in model.parameters())
        plan = plan_split(model, PipelineConfig(), 3, 1, PLUGINS)
        parts += build_model_parts(model, plan, [stage], PipelineConfig(), device="cpu")
    assert not any(t.is_meta for part in parts for t in [*part.parameters(), *part.buffers()])
    torch.testing.assert_close(causal_lm_loss(run_chain(parts, inputs), labels), expected,
                               rtol=0, atol=1e-5)


def test_checkpoint_that_does_not_match_is_refused(tmp_path):
    tiny_model(num_layers=2).save_pretrained(tmp_path)
    model = hf_causal_lm(tiny_config(num_layers=4), checkpoint=str(tmp_path))
    plan = plan_split(model, PipelineConfig(), 2, 1, PLUGINS)
    with pytest.raises(ConfigError, match="has no tensor for"):
        build_model_parts(model, plan, [1], PipelineConfig(), device="cpu")


@pytest.mark.cli
def test_plugin_stays_out_of_the_way_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from pp_core.plugin_manager import load_plugins\n"
        "plugins = load_plugins()\n"
        "assert not [b for b in plugins.broken if b.name == 'pp_core_builtins.transformers'], plugins.broken\n"
        "import pp_core_builtins.transformers\n"
        "print(pp_core_builtins.transformers.PP_CORE_UNAVAILABLE)\n"
        "from torch import nn\n"
        "assert not plugins.splitters.get('hf_decoder').accepts(nn.Linear(2, 2))\n"
        "try:\n"
        "    plugins.models.get('hf_causal_lm')({'model_type': 'llama'})\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "transformers is not installed; pip install 'pp-core-torch[transformers]'" in out.stdout
    assert "PluginError model 'hf_causal_lm' needs Hugging Face transformers" in out.stdout


def _docs_plugin():
    """The third-party example of docs/transformers.md, executed as a plugin module."""
    import re
    import types
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "transformers.md").read_text()
    section = docs.split("### Adding an architecture")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("my_pp_arch")
    exec(compile(code, "docs/transformers.md", "exec"), module.__dict__)
    return module


def test_docs_example_adds_an_architecture_with_a_higher_priority_splitter():
    plugins = plugins_with("pp_core_builtins.splitters.fqn", "pp_core_builtins.splitters.layers",
                           "pp_core_builtins.transformers", ("my_pp_arch", _docs_plugin()))
    model = tiny_model()
    model.config.model_type = "my_arch"
    model.config.my_embedding_scale = 2.0
    inputs, _ = batch()
    plan = plan_split(model, PipelineConfig(), 2, 1, plugins)
    assert plan.splitter == "hf_my_arch"
    parts = build_model_parts(model, plan, [0, 1], PipelineConfig())
    hidden = parts[0](**inputs)[0]
    model.config.my_embedding_scale = 1.0
    assert not torch.allclose(hidden, parts[0](**inputs)[0])  # the adapter's embed ran
    torch.testing.assert_close(run_chain(parts, inputs), model(**inputs).logits, rtol=0, atol=1e-5)
    assert plan_split(tiny_model(), PipelineConfig(), 2, 1, plugins).splitter == "hf_decoder"


def test_gradient_norm_counts_a_tied_weight_once():
    """pp-core run's clipping norm over split tied parts equals the unsplit model's norm."""
    from pp_core.parallel.gradients import clip_grad_norm, tied_copies

    reference = tiny_model(tie_word_embeddings=True)
    model = copy.deepcopy(reference)
    _, parts = build(model, 3)
    inputs, labels = batch()
    causal_lm_loss(run_chain(parts, inputs), labels).backward()
    sync_tied_gradients_of(parts, [0, 0, 0], rank=0)
    causal_lm_loss(reference(**inputs).logits, labels).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    params = [p for part in parts for p in part.parameters()]
    skip = tied_copies(parts, range(len(parts)))
    assert len(skip) == 1  # lm_head's copy on the last stage
    assert clip_grad_norm(params, None, None, skip) == pytest.approx(expected, rel=1e-6)
    assert clip_grad_norm(params, None, None) > expected  # counted twice without it


def test_sequence_parallel_plan_and_whole_sequence_masks():
    """Sequence parallelism's pieces on one process (tests/tensor_parallel/test_tensor_parallel.py runs them at
    pp2 x tp2 against the unsplit model): the plan, the whole-sequence stand-in the masks and
    the rotary table are built from, the shard of given inputs_embeds, the refusals."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel
    from pp_core_builtins.transformers.forward import _sequence_shard, _whole_sequence
    from pp_core_builtins.transformers.tp_plan import SequenceShards, hf_decoder_plan

    model = tiny_model()
    plain, sp = hf_decoder_plan(model, False), hf_decoder_plan(model, True)
    assert set(sp) - set(plain) == {"model", "model.layers.*.input_layernorm",
                                    "model.layers.*.post_attention_layernorm", "model.norm"}
    assert isinstance(sp["model.norm"], SequenceParallel) and isinstance(sp["model"], SequenceShards)
    assert sp["model.layers.*.self_attn.q_proj"].input_layouts == (Shard(1),)
    assert sp["model.layers.*.mlp.down_proj"].output_layouts == (Shard(1),)
    assert sp["model.embed_tokens"].output_layouts == (Shard(1),)
    assert sp["lm_head"].input_layouts == (Shard(1),)
    assert sp["lm_head"].output_layouts == (Replicate(),)
    assert plain["model.layers.*.mlp.down_proj"].output_layouts == (Replicate(),)

    class Mesh:  # what the forward reads of a 1-D tp DeviceMesh (one of size 2 needs 2 ranks)
        def __init__(self, rank):
            self.rank = rank

        def size(self):
            return 2

        def get_local_rank(self):
            return self.rank

    text = model.model
    hidden, positions = torch.randn(2, 12, 32), torch.arange(12)[None]
    assert _whole_sequence(text, hidden, positions) is hidden
    whole = _whole_sequence(text, hidden[:, :6], positions)  # a tp rank's sequence shard
    assert whole.shape == (2, 12, 0) and whole.dtype == hidden.dtype
    assert torch.equal(torch.cat([_sequence_shard(hidden, Mesh(r)) for r in (0, 1)], 1), hidden)
    text.pp_sequence_shards = Mesh(0)
    with pytest.raises(ValueError, match="must divide by tp_size .*got 13 tokens at tp_size 2"):
        _whole_sequence(text, hidden[:, :7], torch.arange(13)[None])
    with pytest.raises(ValueError, match="inputs_embeds of 13 tokens at tp_size 2"):
        _sequence_shard(torch.randn(2, 13, 32), Mesh(0))
