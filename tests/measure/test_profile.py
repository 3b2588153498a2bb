"""The units of a model and the profiler: what a unit is for each built-in splitter, the bytes a
microbatch keeps alive, the model left as found, and the link between two gloo ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from pp_core import ConfigError
from pp_core.losses import cross_entropy, mse
from pp_core.planning.costs import ModelProfile
from pp_core.measure.link import measure_p2p
from pp_core.measure.profile import profile_model
from pp_core.planning.units import model_units
from pp_core.testing import plugins_with
from pp_core_builtins.models.gpt import GPT

PLUGINS = plugins_with("pp_core_builtins.splitters.fqn", "pp_core_builtins.splitters.layers", "pp_core_builtins.splitters.sequential")


class RootParam(nn.Module):
    """A layers-contract model with a parameter on the root and a parameter-free module."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.embed = nn.Linear(3, 4)
        self.act = nn.Tanh()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        if self.embed is not None:
            x = self.act(self.embed(x)) * self.scale
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def test_units_follow_the_splitters():
    gpt = GPT(vocab_size=32, dim=16, num_layers=3, num_heads=2, max_seq_len=8)
    assert model_units(gpt, PLUGINS) == [("tok_embeddings", "pos_embeddings"), ("layers.0",),
                                         ("layers.1",), ("layers.2",), ("norm", "output")]
    assert model_units(RootParam(), PLUGINS) == [("embed", "act", "scale"), ("layers.0",),
                                                 ("layers.1",), ("layers.2",), ("head",)]
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert model_units(seq, PLUGINS) == [("0",), ("1",), ("2",)]


def test_a_model_without_units_is_a_clear_error():
    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="no splitter can split Opaque"):
        model_units(Opaque(), PLUGINS)

    class NoUnits:
        name = "mine"

        def split(self, model, num_stages, config):
            return [["body"]]

    with pytest.raises(ConfigError, match="splitter 'mine' cannot list the units of Opaque .*"
                                          "module_fqns_per_model_part"):
        model_units(Opaque(), PLUGINS, splitter=NoUnits())


def chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def test_profile_counts_bytes_per_unit_and_scales_with_the_microbatch():
    model = chain()
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    profiles = profile_model(model, x, y, mse, [2, 4], repeats=1, plugins=PLUGINS)
    assert sorted(profiles) == [2, 4]
    for size, prof in profiles.items():
        assert prof.microbatch_size == size and prof.device == "cpu" and prof.shared_fqns == ()
        first, relu, last = prof.units
        assert [u.fqns for u in prof.units] == [("0",), ("1",), ("2",)]
        assert first.param_bytes == (4 * 8 + 8) * 4 and relu.param_bytes == 0
        assert last.param_bytes == (8 * 3 + 3) * 4
        assert first.output_bytes == relu.output_bytes == size * 8 * 4 and last.output_bytes == 0
        assert first.activation_bytes == size * 4 * 4   # the microbatch (weights not counted)
        assert relu.activation_bytes == size * 8 * 4    # its result
        assert last.activation_bytes >= size * 8 * 4    # its input, then the loss's
        # of those, its input (what a stage starting with it keeps of the received buffer):
        # ReLU keeps its result, the Linear its input; the first unit's is the batch
        assert (first.saved_input_bytes, relu.saved_input_bytes, last.saved_input_bytes) == \
            (0, 0, size * 8 * 4)
        for unit in prof.units:
            times = (unit.forward_s, unit.backward_s, unit.input_grad_s, unit.weight_grad_s)
            assert all(math.isfinite(t) and t >= 0 for t in times)
    assert [2 * u.activation_bytes for u in profiles[2].units] == \
        [u.activation_bytes for u in profiles[4].units]


def test_profile_leaves_gradients_parameters_and_rng_as_found():
    model = GPT(vocab_size=32, dim=16, num_layers=3, num_heads=2, max_seq_len=8)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 32, (4, 8))
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    prof = profile_model(model, tokens, tokens, cross_entropy, [2], repeats=2, plugins=PLUGINS)[2]
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [u.fqns[0] for u in prof.units] == ["tok_embeddings", "layers.0", "layers.1",
                                               "layers.2", "norm"]
    assert sum(u.param_bytes for u in prof.units) == sum(p.numel() * 4 for p in model.parameters())
    # the embedding's unit runs alone (an empty `layers` on its part), the head gets the loss
    assert prof.units[0].output_bytes == 2 * 8 * 16 * 4 and prof.units[-1].output_bytes == 0
    assert ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


def test_profile_errors():
    model, x = chain(), torch.randn(6, 4)
    with pytest.raises(ConfigError, match="microbatch size 4 does not divide the inputs batch "
                                          "of 6"):
        profile_model(model, x, x, mse, [4], plugins=PLUGINS)
    with pytest.raises(ConfigError, match="microbatch_sizes=\\[0\\] must be positive ints"):
        profile_model(model, x, x, mse, [0], plugins=PLUGINS)
    with pytest.raises(ConfigError, match="repeats=0"):
        profile_model(model, x, x, mse, [2], repeats=0, plugins=PLUGINS)
    with pytest.raises(ConfigError, match="clock='sun': expected one of 'auto', 'wall', 'cpu'"):
        profile_model(model, x, x, mse, [2], clock="sun", plugins=PLUGINS)
    with torch.device("meta"):
        meta = chain()
    with pytest.raises(ConfigError, match="meta device; materialise it"):
        profile_model(meta, x, x, mse, [2], plugins=PLUGINS)


def test_profile_of_a_hugging_face_decoder_uses_its_splitter():
    pytest.importorskip("transformers")
    from pp_core_builtins.transformers import causal_lm_loss
    from tests.cases.hf import batch, tiny_model

    model = tiny_model("llama", num_layers=2)
    inputs, labels = batch(batch_size=2)
    plugins = plugins_with("pp_core_builtins.splitters.fqn", "pp_core_builtins.splitters.layers", "pp_core_builtins.transformers")
    prof = profile_model(model, inputs, labels, causal_lm_loss, [1], repeats=1,
                         plugins=plugins)[1]
    assert [u.fqns for u in prof.units] == [("model.embed_tokens",), ("model.layers.0",),
                                            ("model.layers.1",), ("model.norm", "lm_head")]
    assert prof.shared_fqns == ("model.rotary_emb",)
    assert all(u.activation_bytes > 0 for u in prof.units)


def p2p_on_every_rank():
    from pp_core.measure.link import measure_p2p_busy

    latency, bandwidth = measure_p2p(None, (4, 1 << 16))
    with pytest.raises(ConfigError, match="must end larger"):
        measure_p2p(None, (8, 8))
    with pytest.raises(ConfigError, match="must end larger"):
        measure_p2p_busy(None, (8, 8))
    from pp_core.measure.overhead import measure_action_overhead

    return (latency, bandwidth) + measure_p2p_busy(None, (4, 1 << 16), count=5) + \
        (measure_action_overhead(steps=2),)


@pytest.mark.ranks
def test_measure_p2p_gives_every_rank_the_same_link(pools):
    first, second = pools(2).run(p2p_on_every_rank)
    assert first == second
    latency, bandwidth, send_busy, recv_busy, busy_rate, per_action = first
    assert 0 < latency < 1 and 0 < bandwidth < math.inf
    # a message costs both ranks CPU time: gloo frames and copies it in either process
    assert 0 < send_busy < 1 and 0 < recv_busy < 1 and busy_rate > 0
    # a real pipeline's executor spends time of its own on every action
    assert 0 < per_action < 1
