"""The ``hf_causal_lm`` factory: built from a config dict, never downloading, on meta, in a dtype.

The tiny models every ``transformers`` test uses live in :mod:`tests.cases.hf`.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pp_core import ConfigError, PipelineConfig  # noqa: E402
from pp_core_builtins.transformers import causal_lm_loss, hf_causal_lm  # noqa: E402
from tests.cases.hf import batch, reference_step, tiny_config, tiny_model  # noqa: E402


def test_hf_causal_lm_builds_from_config_dict_with_seed():
    a, b = tiny_model(seed=3), tiny_model(seed=3)
    assert type(a).__name__ == "LlamaForCausalLM"
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.pp_checkpoint is None


def test_hf_causal_lm_matches_transformers_loss():
    model = tiny_model()
    inputs, labels = batch()
    expected = model(**inputs, labels=labels).loss
    assert torch.allclose(causal_lm_loss(model(**inputs).logits, labels), expected, atol=1e-6)


def test_hf_causal_lm_requires_model_type():
    with pytest.raises(ConfigError, match="needs a model_type"):
        hf_causal_lm({"hidden_size": 8})


def test_hf_causal_lm_never_downloads(tmp_path):
    with pytest.raises(ConfigError, match="never downloads"):
        hf_causal_lm("meta-llama/Llama-3.2-1B")


def test_hf_causal_lm_on_meta_from_saved_directory(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    meta = hf_causal_lm(str(tmp_path))
    assert meta.pp_checkpoint == str(tmp_path)
    assert all(p.is_meta for p in meta.parameters())


def test_hf_causal_lm_dtype():
    model = hf_causal_lm(tiny_config(), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_reference_step_is_deterministic():
    model = tiny_model()
    inputs, labels = batch()
    loss_a, grads_a = reference_step(model, inputs, labels, 2)
    loss_b, grads_b = reference_step(copy.deepcopy(model), inputs, labels, 2)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    assert PipelineConfig(pp_batch_size=4, pp_microbatch_size=2).num_microbatches == 2
