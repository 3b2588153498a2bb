"""Tiny Hugging Face models, their batches and the unsplit reference step, for every test that
runs a ``transformers`` model (and for their spawned ranks).

No network: every model is built from a config in code, with random weights. Importing this
module skips the importing test module when ``transformers`` is not installed.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

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
