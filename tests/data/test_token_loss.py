"""The token-exact loss (docs/data.md): microbatches with very different numbers of masked
targets; a pipelined step's loss and every gradient equal the unsplit model's loss over the whole
batch, on 2 gloo ranks for every built-in schedule (one pool for the module), with the
receive-buffer pool, with ``scale_grads_in_schedule`` off (gradients of the sum of microbatch
losses: ``M`` times the batch loss's), for a user loss that opts in with its own token count,
and through a tiny HF Llama / Qwen2 with ``causal_lm_loss``. A plain two-argument loss keeps the
mean of microbatch means.

Packed rows (the same pool): documents packed into rows, boundaries carried by position ids that
restart per document, microbatches of unequal document counts and lengths - loss and gradients
equal to one process for every schedule (and with the buffer pool), through the demo GPT and HF
Llama / Qwen2 (SDPA); and a probe that fails if any token attends across a document boundary."""

import pytest
import torch

from pp_core.losses import count_valid_tokens, counts_tokens, cross_entropy
from tests.cases.runtime import SCHEDULES
from tests.cases.packed import leak_case, packed_case
from tests.cases.token import hf_token_case, plain_cross_entropy, token_case

ATOL = 2e-6


pytestmark = pytest.mark.ranks(2, timeout=180)


def check(results, atol=ATOL):
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 1, "exactly one rank returns the loss"
    assert losses[0] <= atol * 5, f"loss differs from the whole batch's by {losses[0]}"
    for rank, result in enumerate(results):
        assert result["grad_err"] <= atol, f"rank {rank}: gradient differs by {result['grad_err']}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_equals_the_whole_batch_loss(pool, schedule):
    results = pool.run(token_case, schedule)
    check(results)
    # the mean of microbatch means is far off on this batch: the comparison can fail
    assert results[0]["naive_gap"] > 1000 * ATOL, results[0]["naive_gap"]


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "v_schedule"])
def test_with_the_buffer_pool(pool, schedule):
    check(pool.run(token_case, schedule, pool=True))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_unscaled_gradients_are_those_of_the_sum(pool, schedule):
    check(pool.run(token_case, schedule, scale=False))


def test_user_loss_opts_in_with_its_own_count(pool):
    check(pool.run(token_case, "1f1b", loss="user"))


@pytest.mark.parametrize("scale", [True, False])
def test_plain_two_argument_loss_keeps_the_mean_of_microbatch_means(pool, scale):
    check(pool.run(token_case, "1f1b", loss="plain", scale=scale))


@pytest.mark.parametrize("schedule,model_type", [("1f1b", "llama"), ("zero_bubble", "qwen2")])
def test_hf_causal_lm_loss_equals_the_whole_batch_loss(pool, schedule, model_type):
    pytest.importorskip("transformers")
    check(pool.run(hf_token_case, schedule, model_type), atol=1e-5)


def test_opt_in_is_a_num_valid_tokens_keyword():
    assert counts_tokens(cross_entropy)
    assert not counts_tokens(plain_cross_entropy)
    assert counts_tokens(lambda output, target, num_valid_tokens=None: 0.0)
    assert not counts_tokens(lambda output, target, *num_valid_tokens: 0.0)
    target = torch.tensor([[1, -100, 3], [-100, -100, 0]])
    assert int(count_valid_tokens(target)) == 3
    assert int(count_valid_tokens({"labels": target})) == 3
    logits = torch.randn(2, 3, 5)
    whole = cross_entropy(logits, target)
    torch.testing.assert_close(cross_entropy(logits, target, num_valid_tokens=3), whole)


# ------------------------------------------------------------------------- packed sequences

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_packed_rows_equal_one_process(pool, schedule):
    check(pool.run(packed_case, schedule))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zero_bubble", "dualpipe_v"])
def test_packed_rows_with_the_buffer_pool(pool, schedule):
    check(pool.run(packed_case, schedule, pool=True))


@pytest.mark.parametrize("schedule,kind", [("1f1b", "llama"), ("v_schedule", "qwen2")])
def test_packed_rows_through_hf_decoders(pool, schedule, kind):
    pytest.importorskip("transformers")
    check(pool.run(packed_case, schedule, kind), atol=1e-5)


@pytest.mark.parametrize("schedule,kind", [("interleaved_1f1b", "gpt"), ("1f1b", "llama")])
def test_no_token_attends_across_a_document_boundary(pool, schedule, kind):
    if kind != "gpt":
        pytest.importorskip("transformers")
    results = [r for r in pool.run(leak_case, schedule, kind) if r["has_output"]]
    assert len(results) == 1
    assert results[0]["first_moved"] > 1e-4, "the probe changed nothing: it cannot fail"
    assert results[0]["others_moved"] == 0.0, \
        f"a later document's outputs moved by {results[0]['others_moved']}: attention leaks"
