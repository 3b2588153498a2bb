"""moe_gpt with expert parallelism through the pipeline, on 4 gloo ranks (pp 2 x dp 2, ep 2):
loss, auxiliary loss, the global gradient norm and every (clipped) gradient equal one process
on the same microbatches, for every schedule kind with and without the receive-buffer pool; the
dispatch workspace is one runtime initializer per rank, prepared before each microbatch.
"""

import pytest

from tests.cases.moe import hf_moe_case, moe_case

SCHEDULES = ["1f1b", "interleaved_1f1b", "zero_bubble", "v_schedule", "dualpipe_v"]
ATOL = 1e-5


pytestmark = pytest.mark.ranks(4, timeout=180)


def check(results) -> None:
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 2, "both dp ranks of the last stage's pp rank return the loss"
    assert max(losses) <= ATOL, f"loss differs by {max(losses)}"
    for rank, result in enumerate(results):
        assert result["grad_err"] <= ATOL, f"rank {rank}: gradient differs by {result['grad_err']}"
        assert result["aux_err"] <= ATOL, f"rank {rank}: aux loss differs by {result['aux_err']}"
        assert result["norm_err"] <= 1e-5 * max(1.0, result["norm"]), (rank, result["norm_err"])
    assert results[0]["aux"] > 0.05, "the aux loss must weigh in for the test to mean anything"


CASES = [(s, p) for s in SCHEDULES for p in (False, True)]


@pytest.mark.parametrize("schedule,pool_buffers", CASES,
                         ids=[f"{s}-{'buffer_pool' if p else 'plain'}" for s, p in CASES])
def test_moe_ep2_equals_one_process(pool, schedule, pool_buffers):
    results = pool.run(moe_case, schedule, pool_buffers)
    check(results)
    if schedule in ("zero_bubble", "v_schedule", "dualpipe_v"):
        split_backward_all_to_alls(results)
    for result in results:  # one workspace per rank, prepared before every microbatch
        assert result["moe_layers"] >= 1
        (grows, prepared, _), = result["workspaces"]
        assert prepared == [8] * result["num_microbatches"] and grows == 1


def split_backward_all_to_alls(results) -> None:
    """Split backward: the all-to-alls of a stage's backward run in I, W stays local - except
    on the first stage, whose I has no input gradient to compute and whose W runs it all."""
    ran_in_i = 0
    for result in results:
        counts = result["all_to_alls"]
        for stage in result["stages"]:
            if stage == 0:
                assert f"{stage}I" not in counts and counts.get(f"{stage}W", 0) > 0, counts
            else:
                assert f"{stage}W" not in counts, f"stage {stage}'s W communicates: {counts}"
                ran_in_i += counts.get(f"{stage}I", 0)
            assert counts.get(f"{stage}F", 0) > 0, counts
    assert ran_in_i > 0


def test_moe_ep1_fsdp_equals_one_process(pool):
    check(pool.run(moe_case, "1f1b", ep=1, engine="fsdp"))


def test_moe_ep2_fsdp_with_activation_checkpointing(pool):
    """FSDP2 shards the dense parameters (experts ignored), every block recomputes its forward
    - all-to-alls included - in backward; aux losses are still counted once."""
    results = pool.run(moe_case, "zero_bubble", engine="fsdp", ac="full")
    check(results)


def test_moe_norm_with_starved_experts(pool):
    """ep rank 1's experts receive no token: no hang, zero gradients there, the norm and the
    clipped gradients still one process's."""
    results = pool.run(moe_case, "zero_bubble", starve=True)
    check(results)
    ep_rank_1 = [r for rank, r in enumerate(results) if rank % 2 == 1]
    assert all(r["expert_grad_zero"] for r in ep_rank_1)
    assert not any(r["expert_grad_zero"] for rank, r in enumerate(results) if rank % 2 == 0)


def test_moe_workspace_grows_a_few_times_over_changing_lengths(pool):
    lens = (3, 5, 8, 2, 7)
    results = pool.run(moe_case, "1f1b", seq_lens=lens, max_norm=None)
    check(results)
    for result in results:
        (grows, prepared, rows), = result["workspaces"]
        assert prepared == [n for n in lens for _ in range(result["num_microbatches"])]
        assert grows <= 3 and rows >= 8 * 2


def test_hf_qwen3_moe_with_ep_equals_one_process(pool):
    """A tiny Qwen3-MoE split by hf_decoder, experts sharded by the transformers plugin's plan;
    zero_bubble, so the all-to-alls also run in split backward's I."""
    pytest.importorskip("transformers")
    results = pool.run(hf_moe_case, "zero_bubble")
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 2 and max(losses) <= ATOL, losses
    for rank, result in enumerate(results):
        assert result["sharded"] == 2, "each stage holds two MoE layers' experts"
        assert result["grad_err"] <= ATOL, (rank, result["grad_err"])
