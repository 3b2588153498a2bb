"""Planning a split: splitter selection, the three built-in splitters, virtual stages, errors."""

import itertools
import random

import pytest
from torch import nn

import pp_core_builtins.splitters.fqn
import pp_core_builtins.splitters.layers
from pp_core import ConfigError, PipelineConfig, PluginError, hookimpl
from pp_core.plugin_manager import load_plugins
from pp_core.planning.split import balanced_partition, plan_split, spread, virtual_stages
from pp_core.testing import plugins_with

from tests.cases.split_models import Chain, TinyLM, mlp

BUILTINS = ("pp_core_builtins.splitters.fqn", "pp_core_builtins.splitters.layers",
            "pp_core_builtins.splitters.sequential")


@pytest.fixture(scope="module")
def plugins():
    return plugins_with(*BUILTINS)


def cfg(**kw):
    return PipelineConfig(**kw)


# ----------------------------------------------------------------------------- selection


@pytest.mark.parametrize("order", list(itertools.permutations(BUILTINS)))
def test_auto_selection_order_does_not_depend_on_registration_order(order):
    plugins = plugins_with(*order)
    both = TinyLM()
    both.pp_sequential = True  # accepted by layers and by sequential: layers wins
    assert plan_split(both, cfg(), 2, 1, plugins).splitter == "layers"
    assert plan_split(mlp(), cfg(), 2, 1, plugins).splitter == "sequential"
    assert plan_split(Chain(), cfg(), 2, 1, plugins).splitter == "sequential"
    fqns = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
    plan = plan_split(TinyLM(), cfg(module_fqns_per_model_part=fqns), 2, 1, plugins)
    assert plan.splitter == "fqn"


def test_builtins_are_installed_through_entry_points():
    registry = load_plugins().splitters
    assert {"fqn", "layers", "sequential"} <= set(registry.names())
    assert registry.entry("layers").plugin == "pp_core_builtins.splitters.layers"


class BlocksSplitter:
    """A third-party splitter for models with a `blocks` ModuleList."""

    def __init__(self, priority=None):
        if priority is not None:
            self.priority = priority

    def accepts(self, model):
        return isinstance(getattr(model, "blocks", None), nn.ModuleList)

    def split(self, model, num_stages, config):
        names = [f"blocks.{i}" for i in range(len(model.blocks))]
        per = len(names) // num_stages
        return [names[i * per:(i + 1) * per] for i in range(num_stages)]


def _plugin(splitter, name="blocks"):
    class Plugin:
        @hookimpl
        def pp_register_splitters(self, register):
            register(name, splitter)

    return Plugin()


def test_hook_pp_register_splitters_third_party_wins_with_priority():
    from pp_core.plugin_manager import make_plugin_manager
    from pp_core.planning.split import select_splitter

    model = nn.Module()  # acceptable to both `layers` and the third-party `blocks`
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    for priority, expected in ((None, "layers"), (250, "blocks")):
        pm = make_plugin_manager(entry_points=False, plugins=[
            _plugin(BlocksSplitter(priority)),
            ("pp_core_builtins.splitters.layers", pp_core_builtins.splitters.layers)])
        assert select_splitter(model, cfg(), pm)[0] == expected
    plan = plan_split(nn.ModuleDict({"blocks": model.blocks}), cfg(), 2, 1, pm)
    assert plan.splitter == "blocks"
    assert plan.fqns_per_stage == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]


def test_named_splitter(plugins):
    assert plan_split(TinyLM(), cfg(), 2, 1, plugins, splitter="LAYERS").splitter == "layers"
    with pytest.raises(ConfigError, match=r"'sequential'.*cannot split TinyLM: not an "
                                          r"nn.Sequential.*pp_sequential = True"):
        plan_split(TinyLM(), cfg(), 2, 1, plugins, splitter="sequential")
    with pytest.raises(PluginError, match=r"unknown splitter 'layer'; did you mean 'layers'"):
        plan_split(TinyLM(), cfg(), 2, 1, plugins, splitter="layer")
    mine = pp_core_builtins.splitters.layers.LayersSplitter()
    mine.name = "mine"
    assert plan_split(TinyLM(), cfg(), 2, 1, plugins, splitter=mine).splitter == "mine"


def test_no_splitter_accepts(plugins):
    model = nn.Module()
    model.encoder = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"no splitter can split Module \(fqn: module_fqns_per_"
                                          r"model_part is not set; layers: no `layers` child.*; "
                                          r"sequential: not an nn.Sequential"):
        plan_split(model, cfg(), 2, 1, plugins)


# ----------------------------------------------------------------------------- layers


def test_layers_puts_children_before_first_and_after_last(plugins):
    plan = plan_split(TinyLM(depth=6), cfg(), 4, 1, plugins)
    assert plan.fqns_per_stage == [
        ["tok_embeddings", "dropout", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["layers.5", "norm", "output"],
    ]
    assert (plan.num_stages, plan.stages_per_rank, plan.num_ranks) == (4, 1, 4)
    assert sum(plan.param_counts) == sum(p.numel() for p in TinyLM(depth=6).parameters())


def test_layers_module_dict_keeps_keys(plugins):
    plan = plan_split(TinyLM(depth=3, dict_layers=True), cfg(), 1, 2, plugins,
                      variable_stages_per_rank=True)
    assert plan.fqns_per_stage == [["tok_embeddings", "dropout", "layers.b0", "layers.b1"],
                                   ["layers.b2", "norm", "output"]]


def test_layers_too_few(plugins):
    with pytest.raises(ConfigError, match=r"model has 3 layers, cannot give 4 stages \(num_ranks="
                                          r"2 x stages_per_rank=2 for schedule '1f1b'\) at least "
                                          r"one each"):
        plan_split(TinyLM(depth=3), cfg(), 2, 2, plugins)


def test_spread_gives_remainder_to_interior_stages():
    assert spread(6, 4) == [1, 2, 2, 1]
    assert spread(7, 4) == [2, 2, 2, 1]
    assert spread(5, 2) == [3, 2]
    assert spread(4, 1) == [4]
    with pytest.raises(ConfigError, match="cannot spread 2 layers over 3 stages"):
        spread(2, 3)


def test_tied_weights_are_reported(plugins):
    plan = plan_split(TinyLM(tied=True), cfg(), 2, 1, plugins)
    assert plan.tied_parameters == [("tok_embeddings.weight", "output.weight")]


def test_root_parameters_go_to_first_stage(plugins):
    import torch

    model = TinyLM()
    model.pos = nn.Parameter(torch.zeros(8))
    assert "pos" in plan_split(model, cfg(), 2, 1, plugins).fqns_per_stage[0]


# ----------------------------------------------------------------------------- sequential


def test_sequential_balances_parameter_counts(plugins):
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 2), nn.Linear(2, 2),
                          nn.Linear(2, 40), nn.Linear(40, 1))
    plan = plan_split(model, cfg(), 2, 1, plugins)
    # counts 110, 0, 22, 6, 120, 41: the best cut leaves max(138, 161) = 161
    assert plan.fqns_per_stage == [["0", "1", "2", "3"], ["4", "5"]]
    assert plan.param_counts == [138, 161]


def test_balanced_partition_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        weights = [rng.choice([0, 1, 5, 9, 30]) for _ in range(n)]
        counts = balanced_partition(weights, stages)
        assert len(counts) == stages and all(counts) and sum(counts) == n

        def cost(cuts):
            bounds = [0, *cuts, n]
            return max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))

        best = min(cost(c) for c in itertools.combinations(range(1, n), stages - 1))
        cuts = list(itertools.accumulate(counts))[:-1]
        assert cost(cuts) == best, (weights, stages, counts)


def test_sequential_layers_per_stage_splits_by_count(plugins):
    plan = plan_split(mlp(), cfg(layers_per_stage=4), 2, 1, plugins)  # 7 children
    assert [len(s) for s in plan.fqns_per_stage] == [4, 3]


def test_sequential_rules(plugins):
    class Custom(nn.Sequential):
        def forward(self, x):  # not a plain chain any more
            return super().forward(x) * 2

    with pytest.raises(ConfigError, match="no splitter can split Custom"):
        plan_split(Custom(nn.Linear(2, 2), nn.Linear(2, 2)), cfg(), 2, 1, plugins)
    with pytest.raises(ConfigError, match=r"model has 2 layers, cannot give 3 stages "
                                          r"\(num_ranks=3 x stages_per_rank=1"):
        plan_split(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), cfg(), 3, 1, plugins)


# ----------------------------------------------------------------------------- fqn


FQNS = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]


def test_fqn_takes_names_and_shares_parameter_free_modules(plugins):
    plan = plan_split(TinyLM(), cfg(module_fqns_per_model_part=FQNS), 2, 1, plugins)
    assert plan.fqns_per_stage == [FQNS[0] + ["dropout"], FQNS[1] + ["dropout"]]


def test_fqn_part_count_must_match_schedule(plugins):
    config = cfg(module_fqns_per_model_part=FQNS)
    with pytest.raises(ConfigError, match=r"has 2 parts, but schedule '1f1b' needs exactly 4 "
                                          r"\(num_ranks=4 x 1 stage\(s\) per rank\)"):
        plan_split(TinyLM(), config, 4, 1, plugins)
    four = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "output"]]
    plan = plan_split(TinyLM(), cfg(module_fqns_per_model_part=four), 2, 2, plugins,
                      variable_stages_per_rank=True)
    assert (plan.num_stages, plan.stages_per_rank) == (4, 2)
    with pytest.raises(ConfigError, match="at least 2 per rank"):
        plan_split(TinyLM(), config, 2, 2, plugins, variable_stages_per_rank=True)


def test_fqn_errors(plugins):
    def plan(parts):
        return plan_split(TinyLM(), cfg(module_fqns_per_model_part=parts), 2, 1, plugins)

    with pytest.raises(ConfigError, match=r"stage 0 names 'layers.7', which is not a module, "
                                          r"parameter or buffer of TinyLM; did you mean 'layers.3'"):
        plan([["tok_embeddings", "layers.7"], FQNS[1]])
    with pytest.raises(ConfigError, match=r"names 'outptu'.*did you mean 'output'"):
        plan([FQNS[0], ["layers.2", "layers.3", "norm", "outptu"]])
    with pytest.raises(ConfigError, match=r"parameters \['layers.1.norm.weight', 'layers.1.norm"
                                          r".bias', 'layers.1.mlp.weight', 'layers.1.mlp.bias'\]"
                                          r" are on no stage; add their modules \(e.g. "
                                          r"'layers.1.norm'\) to a stage"):
        plan([["tok_embeddings", "layers.0"], FQNS[1]])
    # a module named in two parts is tied (one copy per stage, gradients summed), not refused
    tied = plan([FQNS[0] + ["layers.2.mlp"], FQNS[1]]).tied_parameters
    assert set(tied) == {("layers.2.mlp.weight",), ("layers.2.mlp.bias",)}


def test_fqn_may_name_a_parameter(plugins):
    parts = [["tok_embeddings", "layers.0", "layers.1", "layers.2.mlp.weight"],
             ["layers.2.norm", "layers.2.mlp.bias", "layers.3", "norm", "output"]]
    plan = plan_split(TinyLM(), cfg(module_fqns_per_model_part=parts), 2, 1, plugins)
    assert plan.param_counts[0] == 11 * 8 + 2 * (16 + 72) + 64


def test_fqn_splitter_checks_count_itself():
    with pytest.raises(ConfigError, match=r"has 2 parts but the pipeline has 3 stages"):
        pp_core_builtins.splitters.fqn.FqnSplitter().split(TinyLM(), 3,
                                                           cfg(module_fqns_per_model_part=FQNS))


def test_layers_and_sequential_refuse_fqns(plugins):
    with pytest.raises(ConfigError, match=r"splitter 'layers' does not read; use splitter 'fqn'"):
        plan_split(TinyLM(), cfg(module_fqns_per_model_part=FQNS), 2, 1, plugins,
                   splitter="layers")


# ----------------------------------------------------------------------------- virtual stages


@pytest.mark.parametrize("args, expected", [
    ((8, None, 2, 1, False, None), (2, 1)),
    ((8, None, 2, 2, True, None), (4, 2)),
    ((8, 4, 2, 1, False, None), (2, 1)),
    ((8, 2, 2, 2, True, None), (4, 2)),
    ((8, 1, 2, 2, True, None), (8, 4)),
    ((7, 2, 2, 2, True, None), (4, 2)),
    ((10, 3, 2, 2, True, "up"), (4, 2)),
    ((12, 2, 4, None, False, "down"), (4, 1)),
    ((9, 2, 2, None, False, "up"), (6, 3)),
    ((9, 2, 2, None, False, "down"), (4, 2)),
])
def test_virtual_stages(args, expected):
    assert virtual_stages(*args) == expected


def test_plan_returns_stages_per_rank_from_layers_per_stage(plugins):
    plan = plan_split(TinyLM(depth=8), cfg(layers_per_stage=2, pp_schedule="interleaved_1f1b"),
                      2, 2, plugins, variable_stages_per_rank=True)
    assert (plan.num_stages, plan.stages_per_rank) == (4, 2)
    plan = plan_split(TinyLM(depth=8), cfg(layers_per_stage=1), 2, 2, plugins,
                      variable_stages_per_rank=True)
    assert (plan.num_stages, plan.stages_per_rank) == (8, 4)


def test_virtual_stage_errors():
    with pytest.raises(ConfigError, match=r"model has 10 layers and layers_per_stage=4, giving "
                                          r"ceil\(10/4\)=3 stages, which is not a multiple of "
                                          r"num_ranks=2; set layers_per_stage to one of \[5, 6, 7, "
                                          r"8, 9\], or set round_virtual_stages_to_pp_multiple="
                                          r"'up' \(4 stages\) or 'down' \(2 stages\)"):
        virtual_stages(10, 4, 2, 1)
    with pytest.raises(ConfigError, match=r"rounding 'down' would leave 0 stages.*'up' \(4 stages"):
        virtual_stages(3, 1, 4, None, rounding="down")
    with pytest.raises(ConfigError, match=r"6 layers cannot give 8 stages at least one each; set "
                                          r"round_virtual_stages_to_pp_multiple='down'"):
        virtual_stages(6, 1, 8, None, rounding="up")
    with pytest.raises(ConfigError, match=r"giving 4 stages = 2 per rank over num_ranks=2, but "
                                          r"schedule '1f1b' runs exactly 1 stage\(s\) per rank; set "
                                          r"layers_per_stage=4 \(or leave it unset\)"):
        virtual_stages(8, 2, 2, 1, schedule="schedule '1f1b'")
    with pytest.raises(ConfigError, match=r"needs at least 2 stages per rank; set layers_per_stage=2 "
                                          r"or lower"):
        virtual_stages(8, 4, 2, 2, True)


def test_layers_per_stage_needs_a_counting_splitter(plugins):
    with pytest.raises(ConfigError, match=r"layers_per_stage=1 is set, but splitter "
                                          r"'BlocksSplitter' does not count layers"):
        plan_split(TinyLM(), cfg(layers_per_stage=1), 2, 1, plugins,
                   splitter=BlocksSplitter())


def test_fqns_win_over_layers_per_stage_with_a_warning(plugins):
    """NeMo: module_fqns_per_model_part "overrides automatic layer splitting"."""
    with pytest.warns(UserWarning, match=r"layers_per_stage=2 are both set; the module lists "
                                         r"fix the stages, so layers_per_stage is ignored"):
        plan = plan_split(TinyLM(), cfg(module_fqns_per_model_part=FQNS, layers_per_stage=2), 2,
                          1, plugins)
    assert [fqns[:len(part)] for fqns, part in zip(plan.fqns_per_stage, FQNS)] == FQNS


def test_docs_example_splitter_runs():
    import re
    import sys
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "splitting.md").read_text()
    section = docs.split("## Writing a splitter")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = type(sys)("docs_splitting_example")
    exec(compile(code, "docs/splitting.md", "exec"), module.__dict__)
    model = nn.Module()
    model.embed = nn.Embedding(5, 4)
    model.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))
    model.layers = nn.ModuleList([nn.Linear(4, 4)])  # `layers` accepts too, but loses on priority
    model.head = nn.Linear(4, 5)
    with_layers = plugins_with(module, *BUILTINS)
    with pytest.raises(ConfigError, match=r"parameters \['layers.0.weight'"):
        plan_split(model, cfg(), 2, 1, with_layers)  # the example does not place `layers`
    del model.layers
    plan = plan_split(model, cfg(layers_per_stage=3), 2, 1, with_layers)
    assert plan.splitter == "blocks"
    assert plan.fqns_per_stage == [["embed", "blocks.0", "blocks.1", "blocks.2"],
                                   ["blocks.3", "blocks.4", "head"]]
