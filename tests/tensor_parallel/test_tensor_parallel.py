"""PP x TP on 4 gloo ranks (mesh pp 2 x tp 2): the demo GPT's parts sharded with
``apply_tensor_parallel`` (the built-in plan from the ``pp_tensor_parallel_plan`` hook) must give
the loss and every gradient (``full_tensor()``) of one process, for every built-in schedule, with
and without the receive-buffer pool, with sequence parallelism on and off; DTensors returned by
a stage cross to the next as local shards with their placements; and each step issues exactly
the collectives the plan implies per block and microbatch - none per pipeline action."""

import pytest

from tests.cases.runtime import SCHEDULES
from tests.cases.tp import expected_collectives, hf_matrix, tp_matrix

RTOL = 1e-5
MICROBATCHES = 4


pytestmark = pytest.mark.ranks(4, timeout=240)


def check(results, variant) -> None:
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 2, "both tp ranks of the last stage return the loss"
    assert max(losses) <= RTOL, (variant, losses)
    for rank, result in enumerate(results):
        assert result["grad_err"] <= RTOL, (variant, rank, result["grad_err"])
        assert result["modules"] > 0, "the plan parallelized nothing"
        # the clipping norm over pp x tp (sharded, strided-sharded and replicated grads)
        assert result["norm_err"] <= RTOL, (variant, rank, result["norm_err"])
    # each parameter is held by both tp ranks of one pp rank, and every one is covered
    names = [n for r in results if r["tp_rank"] == 0 for n in r["names"]]
    assert len(names) == len(set(names)) == 4 * 8 + 5, names  # 8 per block; embeddings, norm, head
    sharded = {p for r in results for p in r["placements"]}
    assert "(Shard(dim=0),)" in sharded and "(Shard(dim=1),)" in sharded, sharded


def check_counts(results, sequence_parallel: bool) -> None:
    num_stages = 1 + max(s for r in results for s in r["stages"])
    for rank, result in enumerate(results):
        want = expected_collectives(result["stages"], 4, num_stages, MICROBATCHES,
                                    sequence_parallel)
        assert result["counts"] == want, (rank, result["stages"], result["counts"], want)


# every schedule with the pool off and on and sequence parallelism off and on (paired, to keep
# the suite fast; test_dtensors_cross_stages runs the full 2 x 2 for three schedule kinds)
VARIANTS = [dict(sequence_parallel=False, pool=False, count=True),
            dict(sequence_parallel=True, pool=True)]


def check_variants(runs, schedule: str, variants) -> None:
    """Each variant's results on every rank against one process; the collectives counted where
    the variant asks for it."""
    for index, variant in enumerate(variants):
        results = [runs_of_rank[index] for runs_of_rank in runs]
        check(results, (schedule, variant))
        if variant.get("count"):
            check_counts(results, variant["sequence_parallel"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp_tp_equals_one_process(pool, schedule):
    """Every built-in schedule: plain / buffer pool, sequence parallel off / on."""
    check_variants(pool.run(tp_matrix, schedule, VARIANTS), schedule, VARIANTS)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "v_schedule"])
def test_dtensors_cross_stages(pool, schedule):
    """A plan whose blocks return DTensors (sequence shards, or replicated): the stage output
    travels as its local shard with the placements in the header, the next stage gets a
    DTensor back; numbers as with local tensors, and no extra collective."""
    variants = [dict(sequence_parallel=sp, boundary="dtensor", pool=buffers, count=not buffers)
                for sp in (False, True) for buffers in (False, True)]
    check_variants(pool.run(tp_matrix, schedule, variants), schedule, variants)


# (schedule, architecture, receive-buffer pool, sequence parallelism[, inputs_embeds])
HF_CASES = [("1f1b", "llama", False, False), ("zero_bubble", "llama_tied", True, False),
            ("interleaved_1f1b", "llama_tied", False, False), ("1f1b", "qwen2", True, False),
            ("v_schedule", "mistral", False, False),
            ("1f1b", "llama", False, True), ("zero_bubble", "llama_tied", True, True),
            ("interleaved_1f1b", "qwen2", False, True), ("v_schedule", "mistral", True, True),
            ("1f1b", "llama", False, True, True)]


def test_hf_decoders_pp_tp_equal_one_process(pool):
    """Tiny random HF Llama (untied and tied embeddings: the tied pair sharded alike on its two
    stages), Qwen2 and Mistral, with the built-in plan of pp_core_builtins.transformers; with
    sequence parallelism too (sequence shards between blocks and stages, masks and rotary tables
    for the whole sequence on every stage), also given inputs_embeds."""
    pytest.importorskip("transformers")
    runs = pool.run(hf_matrix, HF_CASES)
    for index, case in enumerate(HF_CASES):
        results = [runs_of_rank[index] for runs_of_rank in runs]
        losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
        assert len(losses) == 2 and max(losses) <= RTOL, (case, losses)
        for rank, result in enumerate(results):
            assert result["grad_err"] <= RTOL, (case, rank, result["grad_err"])
            assert result["modules"] > 0
            # SequenceParallel makes the norms' weights replicated DTensors; nothing else is
            norms = [n for n in result["names"] if n.endswith("norm.weight")]
            assert norms and sorted(result["replicated"]) == (sorted(norms) if case[3] else []), \
                (case, rank, result["replicated"])
