"""Building model parts: names kept, tensors shared (no copies), forward/backward equal to the
unsplit model when the parts run in sequence, meta-device models materialised per part."""

import pytest
import torch
from torch import nn

from pp_core import ConfigError, PipelineConfig, PluginError
from pp_core.planning.parts import build_model_parts, prune_model
from pp_core.planning.split import plan_split
from pp_core.testing import plugins_with

from tests.cases.split_models import Chain, TinyLM, mlp

PLUGINS = plugins_with("pp_core_builtins.splitters.fqn", "pp_core_builtins.splitters.layers",
                       "pp_core_builtins.splitters.sequential")
CFG = PipelineConfig()


def split(model, num_stages, config=CFG, **kw):
    plan = plan_split(model, config, num_stages, 1, PLUGINS, **kw)
    return plan, build_model_parts(model, plan, range(plan.num_stages), config)


def run_chain(parts, x):
    for part in parts:
        x = part(*x) if isinstance(x, tuple) else part(x)
    return x


CASES = {
    "layers_list": (lambda: TinyLM(depth=5), lambda: torch.randint(0, 11, (3, 4))),
    "layers_dict": (lambda: TinyLM(depth=5, dict_layers=True), lambda: torch.randint(0, 11, (3, 4))),
    "tied": (lambda: TinyLM(depth=4, tied=True), lambda: torch.randint(0, 11, (3, 4))),
    "sequential": (lambda: mlp((4, 8, 8, 8, 8, 2)), lambda: torch.randn(5, 4)),
    "declared_chain": (lambda: Chain(), lambda: torch.randn(5, 6)),
}


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_parts_in_sequence_equal_the_model(case, num_stages):
    torch.manual_seed(0)
    make_model, make_input = CASES[case]
    model, x = make_model(), make_input()
    expected = model(x)
    expected.float().pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    plan, parts = split(model, num_stages)
    out = run_chain(parts, x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().pow(2).sum().backward()
    for name, p in model.named_parameters():  # parts share the model's parameters
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_parts_keep_names_share_tensors_and_cover_the_model(case):
    model = CASES[case][0]()
    model_state = model.state_dict(keep_vars=True)
    plan, parts = split(model, 3)
    seen = set()
    for part in parts:
        state = part.state_dict(keep_vars=True)
        assert set(state) <= set(model_state)
        for key, tensor in state.items():
            assert tensor is model_state[key], key  # the very same tensor object: no copy
        seen |= set(state)
    assert seen == set(model_state)
    owned = [set(dict(p.named_parameters())) for p in parts]
    for a in range(len(parts)):
        for b in range(a + 1, len(parts)):
            assert not owned[a] & owned[b]


def test_layers_part_structure():
    model = TinyLM(depth=6)
    _, parts = split(model, 3)
    first, middle, last = parts
    assert first.norm is None and first.output is None and first.tok_embeddings is not None
    assert middle.tok_embeddings is None and middle.norm is None
    assert [k for k, _ in middle.layers.named_children()] == ["2", "3"]
    assert list(middle.layers) == [model.layers[2], model.layers[3]]
    assert last.output is model.output and last.scale is model.scale  # root buffer on every part
    assert len(model.layers) == 6 and model.norm is not None  # the model itself is untouched
    assert type(middle) is TinyLM and middle is not model


def test_hooks_on_one_part_do_not_fire_on_another():
    model = TinyLM(depth=2)
    _, (first, last) = split(model, 2)
    calls = []
    first.register_forward_hook(lambda *a: calls.append("first"))
    first(torch.randint(0, 11, (1, 2)))
    last(torch.randn(1, 2, 8))
    model(torch.randint(0, 11, (1, 2)))
    assert calls == ["first"]


def test_fqn_parts_with_a_shared_parameter_free_module():
    fqns = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "norm", "output"]]
    model = TinyLM()
    config = PipelineConfig(module_fqns_per_model_part=fqns)
    plan, parts = split(model, 3, config)
    assert all(part.dropout is model.dropout for part in parts)
    x = torch.randint(0, 11, (2, 3))
    torch.testing.assert_close(run_chain(parts, x), model(x), rtol=0, atol=0)


def test_stage_indices_pick_this_ranks_parts_in_order():
    model = TinyLM(depth=4)
    plan = plan_split(model, CFG, 2, 2, PLUGINS, variable_stages_per_rank=True)
    parts = build_model_parts(model, plan, (3, 0), CFG)
    assert parts[0].output is model.output and parts[1].tok_embeddings is model.tok_embeddings
    with pytest.raises(ConfigError, match=r"stage_indices=\[0, 4\] must be distinct ints in "
                                          r"\[0, 4\) for a plan of 4 stages"):
        build_model_parts(model, plan, [0, 4], CFG)


def test_prune_model_names_a_single_parameter():
    model = TinyLM(depth=1)
    part = prune_model(model, ["layers.0.mlp.weight"])
    assert list(part.state_dict()) == ["layers.0.mlp.weight"]
    assert part.layers[0].mlp.bias is None and model.layers[0].mlp.bias is not None


def test_make_part_must_keep_names():
    class Renaming:
        def accepts(self, model):
            return True

        def split(self, model, num_stages, config):
            return [["0"], ["1", "2"]]

        def make_part(self, model, fqns, stage_index, num_stages, config):
            return nn.Sequential(*(model._modules[name] for name in fqns))  # renumbers keys

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    plan = plan_split(model, CFG, 2, 1, PLUGINS, splitter=Renaming())
    with pytest.raises(PluginError, match=r"splitter 'Renaming' built stage 1 with state_dict "
                                          r"keys the model does not have: \['1.bias', '1.weight'\]"):
        build_model_parts(model, plan, [0, 1], CFG)


# ----------------------------------------------------------------------------- meta device


def test_meta_model_materialises_only_this_ranks_parts():
    with torch.device("meta"):
        model = TinyLM(depth=4, tied=True)
    plan = plan_split(model, CFG, 2, 2, PLUGINS, variable_stages_per_rank=True)
    parts = build_model_parts(model, plan, [0, 3], CFG, device="cpu")  # V placement: rank 0
    for part in parts:
        assert not any(t.is_meta for t in part.parameters())
        assert all(torch.isfinite(t).all() for t in part.parameters())
    first, last = parts
    assert last.output.weight is first.tok_embeddings.weight  # tie kept across this rank's parts
    assert last.scale.item() == 0.5  # init_weights refilled the buffer
    assert all(p.is_meta for p in model.layers[1].parameters())  # other ranks' stages: no storage
    assert all(p.is_meta for p in model.layers[2].parameters())


def test_meta_sequential_uses_reset_parameters_or_init_fn():
    with torch.device("meta"):
        model = mlp()
    plan = plan_split(model, CFG, 2, 1, PLUGINS)
    (part,) = build_model_parts(model, plan, [1], CFG, device="cpu")
    assert not any(p.is_meta for p in part.parameters()) and part[-1].weight.abs().sum() > 0
    (part,) = build_model_parts(model, plan, [0], CFG, device="cpu",
                                init_fn=lambda p: [t.data.fill_(1.0) for t in p.parameters()])
    assert all((t == 1).all() for t in part.parameters())
