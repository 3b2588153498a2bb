"""The ``balanced`` splitter: cuts by a profile, never guesses without one, builds parts with the
base splitter (HF stage forwards), and trains exactly on 2 gloo ranks with an embedding-only
stage."""

from __future__ import annotations

import copy

import pytest
import torch

from pp_core import ConfigError, PipelineConfig, build_pipeline
from pp_core.losses import cross_entropy
from pp_core.planning.costs import ModelProfile, UnitCost
from pp_core.planning.units import model_units
from pp_core.planning.parts import build_model_parts
from pp_core.planning.split import plan_split, select_splitter
from pp_core.testing import plugins_with
from pp_core_builtins.models.gpt import GPT
from pp_core_builtins.splitters.balanced import BalancedSplitter

PLUGINS = plugins_with("pp_core_builtins.splitters.fqn", "pp_core_builtins.splitters.layers", "pp_core_builtins.splitters.sequential",
                       "pp_core_builtins.splitters.balanced")


def gpt(num_layers=4):
    torch.manual_seed(0)
    return GPT(vocab_size=32, dim=16, num_layers=num_layers, num_heads=2, max_seq_len=8)


def synthetic(model, costs, size=2, plugins=PLUGINS):
    """A profile of ``model``'s units with these F+B costs (F = B/2 = cost/3)."""
    units = model_units(model, plugins)
    assert len(units) == len(costs)
    return ModelProfile(size, tuple(UnitCost(u, c / 3, 2 * c / 3, c / 3, c / 3, 0, 0, 0)
                                    for u, c in zip(units, costs)), 0.0, 1e9)


def test_splits_by_measured_cost_not_by_block_count():
    model = gpt(4)  # units: embeddings, 4 blocks, norm+output
    heavy_ends = synthetic(model, [4.0, 1.0, 1.0, 1.0, 1.0, 4.0])
    plan = plan_split(model, PipelineConfig(), 3, 1, PLUGINS, BalancedSplitter(heavy_ends))
    assert plan.splitter == "balanced"
    assert plan.fqns_per_stage == [["tok_embeddings", "pos_embeddings"],
                                   ["layers.0", "layers.1", "layers.2", "layers.3"],
                                   ["norm", "output"]]
    layers = plan_split(model, PipelineConfig(), 3, 1, PLUGINS)  # by count: 1 + 2 + 1 blocks
    assert layers.fqns_per_stage[1] == ["layers.1", "layers.2"]
    # a slow first block: it gets a stage of its own
    slow = synthetic(model, [0.5, 6.0, 1.0, 1.0, 1.0, 0.5])
    plan = plan_split(model, PipelineConfig(), 2, 1, PLUGINS, BalancedSplitter(slow))
    assert plan.fqns_per_stage[0] == ["tok_embeddings", "pos_embeddings", "layers.0"]
    # a dict of profiles (what profile_model returns): the config's microbatch size picks one
    both = {2: heavy_ends, 1: slow}
    plan = plan_split(model, PipelineConfig(pp_microbatch_size=1), 2, 1, PLUGINS,
                      BalancedSplitter(both))
    assert plan.fqns_per_stage[0][-1] == "layers.0"


def test_layers_per_stage_counts_blocks_as_the_base_splitter_does():
    model = gpt(4)
    profile = synthetic(model, [4.0, 1.0, 1.0, 1.0, 1.0, 4.0])
    plan = plan_split(model, PipelineConfig(pp_schedule="interleaved_1f1b", layers_per_stage=1),
                      2, None, PLUGINS, BalancedSplitter(profile), variable_stages_per_rank=True)
    assert plan.num_stages == 4 and plan.stages_per_rank == 2  # 4 blocks, one per stage
    assert plan.fqns_per_stage[0] == ["tok_embeddings", "pos_embeddings"]  # cost 4: alone
    assert plan.fqns_per_stage[-1] == ["norm", "output"]


def test_parts_of_a_balanced_split_compute_the_model():
    model, reference = gpt(4), gpt(4)
    tokens = torch.randint(0, 32, (2, 8))
    plan = plan_split(model, PipelineConfig(), 3, 1, PLUGINS,
                      BalancedSplitter(synthetic(model, [4.0, 1.0, 1.0, 1.0, 1.0, 4.0])))
    parts = build_model_parts(model, plan, range(3), PipelineConfig())
    assert len(parts[0].layers) == 0 and parts[0].norm is None  # embedding only
    out = tokens
    for part in parts:
        out = part(out)
    loss = cross_entropy(out, tokens)
    expected = cross_entropy(reference(tokens), tokens)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_named_without_a_profile_it_refuses_with_the_fix():
    with pytest.raises(ConfigError, match="splitter 'balanced' has no profile, and does not "
                                          "guess; profile it first: BalancedSplitter\\("
                                          "profile_model\\(.*model.splitter: balanced"):
        plan_split(gpt(), PipelineConfig(), 2, 1, PLUGINS, "balanced")


def test_never_chosen_automatically_and_checks_what_it_is_given():
    model = gpt(2)
    assert select_splitter(model, None, PLUGINS)[0] == "layers"
    other = synthetic(gpt(3), [1.0] * 5)
    with pytest.raises(ConfigError, match="the profile's units \\(5, .*\\) are not this "
                                          "model's \\(4, .*profile this model"):
        plan_split(model, PipelineConfig(), 2, 1, PLUGINS, BalancedSplitter(other))
    with pytest.raises(ConfigError, match="microbatch sizes \\[2\\], but pp_microbatch_size=1"):
        plan_split(model, PipelineConfig(), 2, 1, PLUGINS,
                   BalancedSplitter({2: synthetic(model, [1.0] * 4)}))
    with pytest.raises(ConfigError, match="kind='fast'"):
        BalancedSplitter(kind="fast")
    with pytest.raises(ConfigError, match="module_fqns_per_model_part is set, which splitter "
                                          "'balanced' does not read"):
        BalancedSplitter(synthetic(model, [1.0] * 4)).split(
            model, 2, PipelineConfig(module_fqns_per_model_part=[["layers.0"], ["layers.1"]]))


def test_hugging_face_parts_come_from_hf_decoder():
    pytest.importorskip("transformers")
    from pp_core_builtins.transformers import causal_lm_loss
    from tests.cases.hf import batch, tiny_model

    plugins = plugins_with("pp_core_builtins.splitters.fqn", "pp_core_builtins.splitters.layers", "pp_core_builtins.transformers",
                           "pp_core_builtins.splitters.balanced")
    model = tiny_model("llama", num_layers=3)
    reference = copy.deepcopy(model)
    inputs, labels = batch(batch_size=2)
    profile = synthetic(model, [3.0, 1.0, 1.0, 1.0, 3.0], plugins=plugins)
    config = PipelineConfig()
    plan = plan_split(model, config, 3, 1, plugins, BalancedSplitter(profile, plugins=plugins))
    assert plan.fqns_per_stage == [["model.embed_tokens", "model.rotary_emb"],
                                   ["model.layers.0", "model.layers.1", "model.layers.2",
                                    "model.rotary_emb"],
                                   ["model.norm", "lm_head", "model.rotary_emb"]]
    parts = build_model_parts(model, plan, range(3), config)
    out = parts[0](**inputs)
    for part in parts[1:]:
        out = part(*out) if isinstance(out, tuple) else part(out)
    logits = getattr(out, "logits", out)
    expected = causal_lm_loss(reference(**inputs).logits, labels)
    torch.testing.assert_close(causal_lm_loss(logits, labels), expected, rtol=0, atol=1e-5)


def train_balanced(schedule):
    """One step of a balanced split whose first stage holds only the embeddings, against the
    unsplit model (loss and every gradient)."""
    import torch.distributed as dist

    model, reference = gpt(4), gpt(4)
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    config = PipelineConfig(pp_schedule=schedule, pp_microbatch_size=1, pp_batch_size=4,
                            loss_fn="cross_entropy")
    profile = synthetic(model, [9.0, 1.0, 1.0, 1.0, 1.0, 1.0], size=1)
    pipe = build_pipeline(model, config, splitter=BalancedSplitter(profile))
    loss = pipe.step(tokens, target=tokens)
    ref_losses = [cross_entropy(reference(mb), mb) for mb in tokens.split(1)]
    sum(ref_losses).backward()
    ref = dict(reference.named_parameters())
    err = max((p.grad - ref[name].grad).abs().max().item()
              for part in pipe.model_parts for name, p in part.named_parameters())
    names = [name for part in pipe.model_parts for name, _ in part.named_parameters()]
    want = torch.stack(ref_losses).mean().item()
    return dist.get_rank(), None if loss is None else abs(loss.item() - want), err, names


pytestmark = pytest.mark.ranks(2)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_trains_exactly_on_two_ranks_with_an_embedding_only_stage(pool, schedule):
    results = pool.run(train_balanced, schedule)
    (_, none, err0, names0), (_, loss_err, err1, names1) = results
    assert none is None and loss_err < 1e-6 and err0 < 1e-6 and err1 < 1e-6
    assert names0 == ["tok_embeddings.weight", "pos_embeddings.weight"]
    assert "layers.0.qkv.weight" in names1
