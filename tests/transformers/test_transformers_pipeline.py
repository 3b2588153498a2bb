"""Hugging Face models through ``build_pipeline`` on real gloo ranks, vs the unsplit model.

Every rank builds the same tiny model (same seed), runs one pipelined training step on a batch
with left padding (dict microbatches: input_ids + attention_mask), sums tied gradients with
``sync_tied_gradients``, and compares its own parts' gradients with the unsplit model's run on
the same process (fp32, atol 1e-5). The last stage's rank also compares the loss.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

pytest.importorskip("transformers")


ATOL = 1e-5


def _step_and_compare(schedule, num_layers, extra, batch_size=8, microbatch_size=2,
                      model_type="llama", steps=1, accumulate=False):
    """On every rank: one (or more) pipelined step(s) vs the unsplit model; max |diff| found.

    Tied embeddings are summed by pp-core's tied-weight sync inside ``step`` — no
    extra call. With ``accumulate`` the gradients are not zeroed between steps, so after step k
    they must be k times the reference's (a contribution counted twice would show).
    """
    from pp_core import PipelineConfig, build_pipeline
    from pp_core_builtins.transformers import causal_lm_loss
    from pp_core_builtins.transformers.tied import tied_groups
    from tests.cases.hf import batch, reference_step, tiny_model

    reference = tiny_model(model_type, num_layers, **extra)
    model = copy.deepcopy(reference)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=batch_size,
                            pp_microbatch_size=microbatch_size, loss_fn=causal_lm_loss)
    pipe = build_pipeline(model, config)
    inputs, labels = batch(batch_size)
    worst = 0.0
    synced = len([g for g in tied_groups(pipe.model_parts) if g.local])
    for step in range(steps):
        if not accumulate:
            for part in pipe.model_parts:
                part.zero_grad(set_to_none=True)
        loss = pipe.step(inputs, target=labels)
        expected_loss, grads = reference_step(reference, inputs, labels,
                                              config.num_microbatches)
        if accumulate:
            grads = {name: grad * (step + 1) for name, grad in grads.items()}
        if loss is not None:
            torch.testing.assert_close(loss, expected_loss, rtol=0, atol=ATOL)
            worst = max(worst, (loss - expected_loss).abs().item())
        for part in pipe.model_parts:
            for name, param in part.named_parameters(remove_duplicate=False):
                torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=ATOL,
                                           msg=f"{schedule} stage grad {name}")
                worst = max(worst, (param.grad - grads[name]).abs().max().item())
    return {"stages": pipe.stage_indices, "worst": worst, "synced": synced,
            "has_loss": loss is not None}


def _load_per_rank(directory, schedule):
    """Every rank builds the model on meta and loads only its stages; loss = from_pretrained."""
    from transformers import AutoModelForCausalLM

    from pp_core import PipelineConfig, build_pipeline
    from pp_core_builtins.transformers import causal_lm_loss, hf_causal_lm
    from tests.cases.hf import batch

    model = hf_causal_lm(directory, attn_implementation="eager")
    assert all(p.is_meta for p in model.parameters())
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=4, pp_microbatch_size=2,
                            loss_fn=causal_lm_loss)
    pipe = build_pipeline(model, config)
    loaded = sum(p.numel() for part in pipe.model_parts for p in part.parameters())
    inputs, labels = batch(4)
    loss = pipe.eval_step(inputs, target=labels)
    if loss is None:
        return {"loaded": loaded, "diff": None}
    reference = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    # the token-exact loss (docs/data.md): the whole batch's, not the mean of microbatch means
    expected = causal_lm_loss(reference(**inputs).logits, labels)
    return {"loaded": loaded, "diff": (loss - expected).abs().item(),
            "total": sum(p.numel() for p in reference.parameters())}


@pytest.fixture(scope="module")
def pool2(pools):
    return pools(2, timeout=180)


@pytest.fixture(scope="module")
def pool4(pools):
    return pools(4, timeout=180)


CASES_2 = [
    # schedule, layers, extra config -- pp=2
    ("1f1b", 4, {}),
    ("1f1b", 4, {"tie_word_embeddings": True}),          # tied across ranks: p2p sum
    ("interleaved_1f1b", 4, {"tie_word_embeddings": True}),
    ("zero_bubble", 4, {}),
    ("v_schedule", 4, {"tie_word_embeddings": True}),     # V: stages 0 and 3 on rank 0, local sum
]


@pytest.mark.parametrize("schedule,num_layers,extra", CASES_2,
                         ids=[f"{c[0]}{'-tied' if c[2] else ''}" for c in CASES_2])
def test_pp2_matches_the_unsplit_model(pool2, schedule, num_layers, extra):
    results = pool2.run(_step_and_compare, schedule, num_layers, extra)
    assert sum(r["has_loss"] for r in results) == 1
    if extra.get("tie_word_embeddings"):
        assert [r["synced"] for r in results] == ([1, 0] if schedule == "v_schedule" else [1, 1])


def test_pp2_qwen2_two_steps(pool2):
    pool2.run(_step_and_compare, "1f1b", 4, {}, model_type="qwen2", steps=2)


@pytest.mark.parametrize("schedule", ["1f1b", "v_schedule"])
def test_tied_gradients_accumulate_over_steps_without_double_counting(pool2, schedule):
    pool2.run(_step_and_compare, schedule, 4, {"tie_word_embeddings": True}, steps=2,
              accumulate=True)


CASES_4 = [
    ("1f1b", 4, {"tie_word_embeddings": True}),
    ("interleaved_1f1b", 8, {}),
    ("zero_bubble", 4, {"tie_word_embeddings": True}),
    ("v_schedule", 8, {"tie_word_embeddings": True}),
]


@pytest.mark.parametrize("schedule,num_layers,extra", CASES_4,
                         ids=[f"{c[0]}{'-tied' if c[2] else ''}" for c in CASES_4])
def test_pp4_matches_the_unsplit_model(pool4, schedule, num_layers, extra):
    results = pool4.run(_step_and_compare, schedule, num_layers, extra, batch_size=8,
                        microbatch_size=1)
    if extra.get("tie_word_embeddings"):
        holders = [r["synced"] for r in results]
        assert holders == ([1, 0, 0, 0] if schedule == "v_schedule" else [1, 0, 0, 1])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_each_rank_loads_only_its_stages_from_a_checkpoint(pool2, tied):
    from tests.cases.hf import tiny_model

    directory = tempfile.mkdtemp(prefix="pp_hf_ckpt_")
    tiny_model(tie_word_embeddings=tied, seed=5).save_pretrained(directory,
                                                                 max_shard_size="30KB")
    assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
    results = pool2.run(_load_per_rank, directory, "1f1b")
    diffs = [r["diff"] for r in results if r["diff"] is not None]
    assert len(diffs) == 1 and diffs[0] <= ATOL
    total = next(r["total"] for r in results if r["diff"] is not None)
    assert all(r["loaded"] < total for r in results)  # no rank holds the whole model
