"""The demo plugin ``pp_core_builtins.models``: the GPT follows the ``layers`` contract, the
datasets are deterministic per batch index, and the shipped text is there."""

from __future__ import annotations

import torch

import pp_core_builtins.models
from pp_core import PipelineConfig
from pp_core.losses import cross_entropy, get_loss, resolve_loss
from pp_core.planning.parts import build_model_parts
from pp_core.planning.split import plan_split
from pp_core.testing import plugins_with
from pp_core_builtins.models.datasets import DEFAULT_TEXT, SyntheticLM, TextBytes, synthetic


def small_gpt(**kwargs):
    torch.manual_seed(0)
    return pp_core_builtins.models.GPT(**{"dim": 32, "num_layers": 4, "num_heads": 4, "max_seq_len": 16,
                            **kwargs})


def test_registered_by_the_plugin():
    plugins = plugins_with("pp_core_builtins.models")
    assert plugins.models.get("gpt") is pp_core_builtins.models.GPT
    assert {"synthetic", "text_bytes"} <= set(plugins.datasets.names())


def test_gpt_forward_and_the_layers_contract():
    model = small_gpt()
    names = [name for name, _ in model.named_children()]
    assert names.index("tok_embeddings") < names.index("layers") < names.index("norm")
    tokens = torch.randint(256, (2, 8))
    assert model(tokens).shape == (2, 8, 256)
    plugins = plugins_with("pp_core_builtins.splitters.layers")
    for num_ranks, stages_per_rank in ((2, 1), (2, 2), (4, 1)):
        plan = plan_split(model, PipelineConfig(), num_ranks, stages_per_rank, plugins)
        assert plan.splitter == "layers"
        parts = build_model_parts(model, plan, list(range(plan.num_stages)))
        hidden = tokens
        for part in parts:  # the same forward runs any part
            hidden = part(hidden)
        torch.testing.assert_close(hidden, model(tokens), rtol=0, atol=0)
        keys = [k for part in parts for k in part.state_dict()]
        assert sorted(keys) == sorted(model.state_dict())


def test_gpt_checks_the_sequence_length():
    model = small_gpt(max_seq_len=4)
    try:
        model(torch.zeros(1, 5, dtype=torch.long))
    except ValueError as exc:
        assert "max_seq_len=4" in str(exc)
    else:
        raise AssertionError("expected a ValueError")


def test_cross_entropy_flattens_sequence_logits():
    logits = torch.randn(2, 3, 5)
    target = torch.randint(5, (2, 3))
    expected = torch.nn.functional.cross_entropy(logits.reshape(6, 5), target.reshape(6))
    torch.testing.assert_close(cross_entropy(logits, target), expected)
    assert resolve_loss("cross_entropy") is cross_entropy is get_loss("Cross_Entropy")
    assert resolve_loss("torch.nn.functional:mse_loss") is torch.nn.functional.mse_loss


def test_datasets_are_deterministic_and_skippable():
    stream = SyntheticLM(batch_size=3, seq_len=8, seed=1)
    batches = [b for _, b in zip(range(4), stream)]
    again = SyntheticLM(batch_size=3, seq_len=8, seed=1)
    again.skip(2)
    for (x0, y0), (x1, y1) in zip(batches[2:], again):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    x, y = batches[0]
    assert x.shape == y.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    regression = synthetic(task="regression", batch_size=4, in_dim=3, out_dim=2)
    x, y = next(iter(regression))
    assert x.shape == (4, 3) and y.shape == (4, 2)


def test_text_bytes_uses_the_shipped_text_and_splits_it():
    assert DEFAULT_TEXT.is_file() and DEFAULT_TEXT.stat().st_size > 10_000
    train = TextBytes(batch_size=2, seq_len=16)
    val = TextBytes(batch_size=2, seq_len=16, split="val")
    x, y = next(iter(train))
    assert x.dtype == torch.long and x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(train.data) > 8 * len(val.data)
    text = bytes(next(iter(val))[0][0].tolist()).decode("utf-8", "replace")
    assert text.isprintable() or "\n" in text


def test_blocks_of_two_widths():
    import pytest

    from pp_core_builtins.models.gpt import uneven_gpt

    model = small_gpt(num_layers=3, mlp_ratios=[1, 2, 8])
    assert [block.ffn[0].out_features for block in model.layers.values()] == [32, 64, 256]
    with pytest.raises(ValueError, match="mlp_ratios has 2 entries for num_layers=3"):
        small_gpt(num_layers=3, mlp_ratios=[1, 2])
    uneven = uneven_gpt(vocab_size=64, dim=16, num_layers=4, num_heads=2, narrow=1, wide=4)
    assert [block.ffn[0].out_features for block in uneven.layers.values()] == [16, 16, 64, 64]
    assert "uneven_gpt" in plugins_with("pp_core_builtins.models").models
