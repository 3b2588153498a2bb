"""PP x torch data parallelism on 4 gloo ranks (mesh pp 2 x dp 2): the parts are wrapped with
FSDP2's ``fully_shard`` or DDP after ``build_pipeline``, and ``Pipeline.step`` must drive them:
loss and every full gradient equal to one process on the global batch, for every schedule kind
(split backward included), and one reduce-scatter / all-gather per FSDP unit per step. The models:
an MLP, the demo GPT and a tiny Hugging Face Llama whose embedding is tied to ``lm_head`` across
stages (each copy must end with the unsplit model's gradient: both uses summed once)."""

import pytest

from tests.cases.fsdp import dp_case
from tests.cases.runtime import SCHEDULES as ALL_SCHEDULES

SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "v_schedule", "dualpipe_v"]
ATOL = 1e-5


pytestmark = pytest.mark.ranks(4, timeout=180)


def check(results, units_expected=None):
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 2, "both dp ranks of the last stage's pp rank return the loss"
    assert max(losses) <= ATOL, f"loss differs by {max(losses)}"
    for rank, result in enumerate(results):
        assert result["grad_err"] <= ATOL, f"rank {rank}: gradient differs by {result['grad_err']}"
    names = {n for r in results for n in r["names"]}
    assert len(names) == len([n for r in results[::2] for n in r["names"]])


# every schedule without the receive-buffer pool, the six kinds also with it
CASES = [(s, False) for s in ALL_SCHEDULES] + [(s, True) for s in SCHEDULES]


@pytest.mark.parametrize("schedule,pool_buffers", CASES,
                         ids=[f"{s}-{'buffer_pool' if p else 'plain'}" for s, p in CASES])
def test_fsdp_gradients_equal_one_process(pool, schedule, pool_buffers):
    results = pool.run(dp_case, schedule, "fsdp", pool=pool_buffers)
    check(results)
    fsdp_units_once(results)  # reshard_after_forward=False: one all-gather per unit and step


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_fsdp_gpt_reshard_after_forward(pool, schedule):
    results = pool.run(dp_case, schedule, "fsdp", kind="gpt", reshard_after_forward=True)
    check(results)
    for result in results:  # the microbatch count changes the all-gathers, never the reductions
        assert result["counts"]["reduce_scatter_single"] == result["units"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b"])
def test_ddp_gradients_equal_one_process(pool, schedule):
    check(pool.run(dp_case, schedule, "ddp"))


def test_ddp_with_split_backward_is_refused(pool):
    outcomes = pool.run_outcomes(dp_case, "zero_bubble", "ddp")
    assert all(not o.ok and o.error == "ConfigError" for o in outcomes), outcomes
    assert "replicate() or fully_shard()" in outcomes[0].message


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "dualpipe_v"])
def test_apply_data_parallel_replicate(pool, schedule):
    """The helper's replication (DDP semantics) runs through the same driver - split backward
    included, where DDP itself is refused."""
    check(pool.run(dp_case, schedule, "replicate", kind="gpt"))


def fsdp_units_once(results) -> None:
    for rank, result in enumerate(results):
        assert result["counts"] == {"reduce_scatter_single": result["units"],
                                    "all_gather_single": result["units"]}, (rank, result)


MODEL_CASES = [(kind, s, p) for kind in ("gpt", "hf") for s in SCHEDULES for p in (False, True)]


@pytest.mark.parametrize("kind,schedule,pool_buffers", MODEL_CASES,
                         ids=[f"{k}-{s}-{'buffer_pool' if p else 'plain'}"
                              for k, s, p in MODEL_CASES])
def test_apply_data_parallel_models(pool, kind, schedule, pool_buffers):
    """``apply_data_parallel`` (FSDP2 per block, then per part) on the demo GPT and on the tied
    HF decoder: one process's loss and gradients, tied copies summed once, one collective each
    way per unit and step."""
    if kind == "hf":
        pytest.importorskip("transformers")
    results = pool.run(dp_case, schedule, "helper", kind=kind, pool=pool_buffers)
    check(results)
    fsdp_units_once(results)


AC_COMPILE = [("gpt", "zero_bubble", "full", "aot_eager"), ("hf", "dualpipe_v", "selective", None)]


@pytest.mark.parametrize("kind,schedule,ac,backend", AC_COMPILE,
                         ids=[f"{k}-{s}-ac_{a}{'-compile' if b else ''}"
                              for k, s, a, b in AC_COMPILE])
def test_fsdp_with_activation_checkpointing_and_compile(pool, kind, schedule, ac, backend):
    """AC, then compile, then FSDP2 (the YAML's order) under split backward: the recompute runs
    on the unsharded parameters, so still one all-gather per unit and step."""
    if kind == "hf":
        pytest.importorskip("transformers")
    results = pool.run(dp_case, schedule, "helper", kind=kind, ac=ac, backend=backend)
    check(results)
    fsdp_units_once(results)
