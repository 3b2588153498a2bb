"""What a split backward's I leaves alive for its W: the profiler's per-unit figures against a
stage of several units run whole through pp_core.runtime.backward, and how the memory model adds
them up per stage."""

from __future__ import annotations

import pytest
import torch

from pp_core.losses import cross_entropy
from pp_core.planning.costs import ModelProfile, UnitCost
from pp_core.planning.memory import split_held_bytes
from pp_core.runtime.backward import backward_input, backward_weight
from pp_core.measure.profile import profile_model
from pp_core.measure.transient import Allocations
from pp_core_builtins.models.gpt import GPT

MBS, SEQ, DIM, VOCAB = 2, 16, 32, 512


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(vocab_size=VOCAB, dim=DIM, num_layers=3, num_heads=2, max_seq_len=SEQ)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ))
    return model, profile_model(model, tokens, tokens, cross_entropy, [MBS], repeats=1)[MBS]


def _live(log: Allocations) -> int:
    return sum(delta for _, delta in log.events)


def held_by_stage(modules, with_loss: bool) -> int:
    """One stage of ``modules`` run the way the runtime runs it with a split backward: forward on
    a leaf input, I through ``backward_input`` (the received gradient made in the log: the
    runtime's receive buffer or pool copy), the outputs and the returned input gradient dropped
    (sent away); the bytes alive when W starts beyond those alive after the forward."""
    log = Allocations()
    x = torch.randn(MBS, SEQ, DIM, requires_grad=True)
    target = torch.randint(0, VOCAB, (MBS, SEQ))  # the microbatch's, made before the stage runs
    with log.tracking():
        out = x
        for module in modules:
            out = module(out)
        if with_loss:
            outputs = [cross_entropy(out, target).reshape(())]
            del out  # the logits: a temporary of the forward
        else:  # a middle stage's output is sent (its storage is not this count's business)
            outputs = [out]
    after_forward = _live(log)
    with log.tracking():
        received = None if with_loss else [torch.randn_like(outputs[0])]  # buffer or pool copy
        returned, state = backward_input(outputs, received, [x])
    del outputs, received, returned
    at_weight = _live(log)
    backward_weight(state)
    return at_weight - after_forward


def test_the_profile_adds_up_to_what_a_stage_of_several_units_holds_from_i_to_w(measured):
    """Units: 0 embedding, 1-3 blocks, 4 norm + head. A middle stage of two blocks and a last
    stage of a block and the head, each run whole, hold what split_held_bytes says: per unit
    the I's held gradients and the received gradient W keeps (the one between two blocks too),
    less the log-softmax that dies at the head's I (nothing but W holds the nodes above it)."""
    model, profile = measured
    blocks = [model.layers[str(i)] for i in range(3)]
    stages = [[0], [1, 2], [3, 4]]
    predicted = split_held_bytes(profile, stages)
    middle = held_by_stage(blocks[:2], with_loss=False)
    last = held_by_stage([blocks[2], model.norm, model.output], with_loss=True)
    assert (predicted[1], predicted[2]) == (middle, last)
    block, head = profile.units[1], profile.units[4]
    tokens = MBS * SEQ
    assert block.output_grad_held_bytes == tokens * DIM * 4  # W keeps the whole gradient
    assert block.input_grad_held_bytes >= 6 * tokens * DIM * 4  # at least one per projection
    assert head.input_grad_held_bytes >= tokens * VOCAB * 4  # the logits' gradient
    assert head.input_grad_freed_bytes >= tokens * VOCAB * 4  # the saved log-softmax
    assert predicted[2] < head.input_grad_held_bytes + block.input_grad_held_bytes


def test_the_first_stage_holds_only_the_received_gradient(measured):
    """No differentiable input: its I does nothing, its W runs the whole backward with the
    gradient it received."""
    model, profile = measured
    embedding = profile.units[0]
    assert (embedding.input_grad_held_bytes, embedding.input_grad_freed_bytes) == (0, 0)
    assert embedding.output_grad_held_bytes == embedding.output_bytes == MBS * SEQ * DIM * 4
    assert split_held_bytes(profile, [[0, 1], [2, 3, 4]])[0] == profile.units[1].output_bytes
    assert split_held_bytes(profile, [[0, 1, 2, 3, 4]]) == [0]  # one stage: nothing received


def unit(held, freed, received, output=64):
    return UnitCost(("u",), 1.0, 2.0, 1.0, 1.0, activation_bytes=1000, param_bytes=0,
                    output_bytes=output, input_grad_held_bytes=held,
                    input_grad_freed_bytes=freed, output_grad_held_bytes=received)


def test_split_held_bytes_per_stage():
    profile = ModelProfile(1, (unit(0, 0, 64, output=64), unit(100, 5, 8), unit(200, 7, 16),
                               unit(300, 50, 0, output=0)), 0.0, 1e9)
    # first stage: its boundary; middle: (100 + 8) + (200 + 16) - 7; last: 300 - 50
    assert split_held_bytes(profile, [[0], [1, 2], [3]]) == [64, 317, 250]
    # a stage that does not end a unit's outputs keeps that unit's graph: only the last frees
    assert split_held_bytes(profile, [[0], [1, 2, 3]]) == [64, 108 + 216 + 300 - 50]


def test_a_stored_profile_without_the_fields_loads_and_holds_nothing():
    data = ModelProfile(1, (unit(1, 2, 3),), 0.0, 1e9).to_dict()
    for field in ("input_grad_held_bytes", "input_grad_freed_bytes", "output_grad_held_bytes"):
        del data["units"][0][field]
    loaded = ModelProfile.from_dict(data)
    assert split_held_bytes(loaded, [[0]]) == [0]
    assert loaded.units[0].input_grad_held_bytes == 0
