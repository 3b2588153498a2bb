"""``pp_seq_chunks`` in one process: what it refuses before any traffic (one line naming the
key), and evaluation with slices (loss and outputs equal K = 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pp_core import ConfigError, PipelineConfig, build_pipeline
from pp_core_builtins.models.gpt import GPT
from pp_core_builtins.models.moe_gpt import MoEGPT


def _config(**overrides):
    return PipelineConfig(**{"pp_schedule": "gpipe", "pp_batch_size": 2, "loss_fn": "cross_entropy",
                             "pp_microbatch_size": 1, "pp_seq_chunks": 2, **overrides})


def test_a_model_whose_attention_takes_no_slices_is_refused_by_name():
    with pytest.raises(ConfigError) as caught:
        build_pipeline(nn.Sequential(nn.Linear(4, 4)), _config())
    assert str(caught.value) == (
        "pipeline.pp_seq_chunks > 1: model 'Sequential' cannot take sequence slices (its "
        "attention does not read the earlier slices' keys and values: no pp_seq_slices = True); "
        "set pp_seq_chunks: 1, or use gpt, moe_gpt or a supported Hugging Face decoder")
    with pytest.raises(ConfigError, match="model 'MoEGPT' cannot take sequence slices"):
        build_pipeline(MoEGPT(vocab_size=16, dim=8, num_layers=1, num_heads=2), _config())
    build_pipeline(MoEGPT(vocab_size=16, dim=8, num_layers=1, num_heads=2, aux_loss_coef=0.0),
                   _config())  # the router's losses off: exact over slices


def test_a_loss_not_normalised_over_tokens_is_refused():
    with pytest.raises(ConfigError, match=r"pp_seq_chunks > 1 needs a loss normalised over the "
                                          r"step's valid tokens"):
        build_pipeline(GPT(vocab_size=16, dim=8, num_layers=1, num_heads=2),
                       _config(loss_fn=lambda out, target: out.float().mean()))


def _packed_gpt(num_layers: int):
    """The demo GPT (seeded) and 4 packed rows of 16 tokens: documents of 5 and 11 tokens, so a
    document ends inside a slice of 4; ``(model, ids, inputs)``."""
    torch.manual_seed(0)
    model = GPT(vocab_size=64, dim=32, num_layers=num_layers, num_heads=2, max_seq_len=32)
    ids = torch.randint(0, 64, (4, 16))
    positions = torch.cat([torch.arange(5), torch.arange(11)]).repeat(4, 1)
    return model, ids, {"input_ids": ids, "position_ids": positions}


def test_a_sequence_the_slices_do_not_divide_is_refused():
    pipe = build_pipeline(GPT(vocab_size=16, dim=8, num_layers=1, num_heads=2),
                          _config(pp_seq_chunks=4))
    ids = torch.randint(0, 16, (2, 6))
    with pytest.raises(ConfigError) as caught:
        pipe.step(ids, target=ids)
    assert str(caught.value) == (
        "pipeline.pp_seq_chunks=4 cannot cut inputs of 6 tokens per sequence into equal slices; "
        "use a divisor of 6 (e.g. 3)")


def test_eval_with_slices_equals_the_unsliced_eval():
    import copy

    model, ids, inputs = _packed_gpt(num_layers=2)
    found = {}
    for k in (1, 4):
        pipe = build_pipeline(copy.deepcopy(model), _config(pp_schedule="1f1b", pp_batch_size=4,
                                                            pp_microbatch_size=2, pp_seq_chunks=k))
        found[k] = pipe.eval_step(inputs, target=ids), pipe.eval_step(inputs)
    assert abs(float(found[1][0] - found[4][0])) <= 1e-5
    assert found[4][1].shape == (4, 16, 64)
    assert torch.allclose(found[1][1], found[4][1], atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_hf_decoders_with_slices_equal_the_unsliced_step(model_type):
    """Through the HF plugin's patched attention (sdpa): packed position ids, the HF loss's
    label shift done once over the whole row."""
    import copy

    pytest.importorskip("transformers")
    from pp_core_builtins.transformers import causal_lm_loss, hf_causal_lm
    from tests.cases.hf import batch, tiny_config

    model = hf_causal_lm(tiny_config(model_type, 2), seed=0, attn_implementation="sdpa")
    inputs, labels = batch(4, padding=False)
    seq = labels.shape[1]
    inputs = {"input_ids": inputs["input_ids"],
              "position_ids": torch.cat([torch.arange(3), torch.arange(seq - 3)]).repeat(4, 1)}
    found = {}
    for k in (1, 2):
        pipe = build_pipeline(copy.deepcopy(model), _config(
            pp_schedule="1f1b", pp_batch_size=4, pp_microbatch_size=2, pp_seq_chunks=k,
            loss_fn=causal_lm_loss))
        loss = pipe.step(inputs, target=labels)
        found[k] = loss, {n: p.grad for part in pipe.model_parts
                          for n, p in part.named_parameters()}
    assert abs(float(found[1][0] - found[2][0])) <= 1e-5
    assert max(float((found[1][1][n] - found[2][1][n]).abs().max()) for n in found[1][1]) <= 1e-5


@pytest.mark.parametrize("schedule", ["zero_bubble", "v_schedule"])
def test_split_backward_with_slices_leaves_the_weights_to_w(schedule):
    """Under slices ``I`` gives only input gradients (the stage's and the earlier slices' keys
    and values) and ``W`` the weight gradients, per slice, as without slices; the sum equals
    K = 1 (one process: ``v_schedule`` puts both of its stages on this rank)."""
    import copy

    from pp_core.runtime.observers import ActionObserver

    class Watch(ActionObserver):
        def __init__(self, pipe):
            self.params = {i: list(s.module.parameters()) for i, s in pipe.stages.items()}
            self.changed = {"I": [], "W": []}

        def _grads(self, stage):
            return [None if p.grad is None else p.grad.clone() for p in self.params[stage]]

        def on_action_start(self, action):
            self.before = self._grads(action.stage)

        def on_action_end(self, action):
            kind = action.kind.value
            if kind in self.changed:
                after = self._grads(action.stage)
                self.changed[kind].append(any(
                    (a is None) != (b is None) or (a is not None and not torch.equal(a, b))
                    for a, b in zip(self.before, after)))

    model, ids, inputs = _packed_gpt(num_layers=4)
    found = {}
    for k in (1, 4):
        pipe = build_pipeline(copy.deepcopy(model), _config(pp_schedule=schedule, pp_batch_size=4,
                                                            pp_seq_chunks=k))
        watch = Watch(pipe)
        pipe.add_action_observer(watch)
        loss = pipe.step(inputs, target=ids)
        found[k] = loss, {n: p.grad for part in pipe.model_parts
                          for n, p in part.named_parameters()}
        assert len(watch.changed["W"]) == len(watch.changed["I"]) == 4 * k * pipe.num_stages
        assert not any(watch.changed["I"]) and all(watch.changed["W"]), (k, watch.changed)
    assert abs(float(found[1][0] - found[4][0])) <= 1e-5
    assert max(float((found[1][1][n] - found[4][1][n]).abs().max()) for n in found[1][1]) <= 1e-5


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_with_slices_equals_the_unsliced_step(mode):
    """A checkpointed block's recompute (during the backward) reads the same prefix of keys,
    values and document mask as its slice's forward did (``seq_slices.replaying``)."""
    import copy

    from pp_core.parallel.activation import apply_activation_checkpointing

    model, ids, inputs = _packed_gpt(num_layers=2)
    found = {}
    for k in (1, 4):
        pipe = build_pipeline(copy.deepcopy(model), _config(pp_schedule="zero_bubble",
                                                            pp_batch_size=4, pp_seq_chunks=k))
        assert apply_activation_checkpointing(pipe.model_parts, mode)
        loss = pipe.step(inputs, target=ids)
        found[k] = loss, {n: p.grad for part in pipe.model_parts
                          for n, p in part.named_parameters()}
    assert abs(float(found[1][0] - found[4][0])) <= 1e-5
    assert max(float((found[1][1][n] - found[4][1][n]).abs().max()) for n in found[1][1]) <= 1e-5
