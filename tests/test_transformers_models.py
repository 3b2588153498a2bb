"""Tiny Hugging Face models for the pp_core_builtins.transformers tests; tests of the
``hf_causal_lm`` factory.

No network: every model is built from a config in code, with random weights. The helpers here
are imported by the other ``test_transformers_*`` modules (and by their spawned ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pp_core import ConfigError, PipelineConfig  # noqa: E402
from pp_core_builtins.transformers import causal_lm_loss, hf_causal_lm  # noqa: E402

VOCAB = 64
SEQ = 12

TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHITECTURES = {
    # name: (model_type, extra config) -- each exercises a different path of the stage forward
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen2_sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
                                "max_window_layers": 2}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": 5}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {"sliding_window": 5, "final_logit_softcapping": 3.0}),
    "granite": ("granite", {"embedding_multiplier": 2.0, "logits_scaling": 4.0}),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "cohere": ("cohere", {"logit_scale": 0.5}),
}


def tiny_config(model_type: str = "llama", num_layers: int = 4, **extra) -> dict:
    """A config dict for ``hf_causal_lm`` (``model_type`` plus tiny sizes)."""
    return {"model_type": model_type, **TINY, "num_hidden_layers": num_layers, **extra}


def tiny_model(model_type: str = "llama", num_layers: int = 4, seed: int = 0, **extra):
    """A tiny ``...ForCausalLM`` in float32, eager attention, same weights for the same seed."""
    return hf_causal_lm(tiny_config(model_type, num_layers, **extra), seed=seed,
                        attn_implementation="eager")


def batch(batch_size: int = 4, seq: int = SEQ, padding: bool = True, seed: int = 1):
    """``(inputs dict, labels)``: left padding on odd rows, labels -100 on the padding."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch_size, seq), generator=generator)
    attention_mask = torch.ones(batch_size, seq, dtype=torch.long)
    if padding:
        for row in range(1, batch_size, 2):
            attention_mask[row, : 2 + row] = 0
        input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask}, labels


def reference_step(model, inputs: dict, labels, num_microbatches: int):
    """The unsplit model on one process: sum of microbatch losses backward, mean loss returned.

    The loss is token-exact, as the pipeline's (docs/data.md): microbatch ``m``'s loss is the sum
    of its token losses over the batch's valid-token count ``N``, times ``M`` - so the mean is
    the whole batch's loss however the padding falls into microbatches.
    """
    model.zero_grad(set_to_none=True)
    losses = []
    count = (labels[..., 1:] != -100).sum()
    for index in range(num_microbatches):
        chunk = {k: v.chunk(num_microbatches)[index] for k, v in inputs.items()}
        logits = model(**chunk).logits
        loss = causal_lm_loss(logits, labels.chunk(num_microbatches)[index],
                              num_valid_tokens=count) * num_microbatches
        loss.backward()
        losses.append(loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}  # none for the embedding given inputs_embeds
    return torch.stack(losses).mean(), grads


# ----------------------------------------------------------------------------- factory tests


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
