"""LoRA with FSDP2 (pp2 x dp_shard2, 4 gloo ranks, ``apply_data_parallel`` as the YAML does):
the adapters' gradients equal the unsplit PEFT model's on the global batch, the frozen base gets
none, and a frozen prefix (adapters on the last half of the blocks) still runs no backward.
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from tests.cases.fsdp import dp_case  # noqa: E402


pytestmark = pytest.mark.ranks(4)


@pytest.mark.parametrize("schedule, kind", [("zero_bubble", "lora"), ("1f1b", "lora_late")])
def test_lora_under_fsdp2_matches_one_process(pool, schedule, kind):
    results = pool.run(dp_case, schedule, "helper", kind)
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert losses and max(losses) <= 1e-5, losses
    for rank, result in enumerate(results):
        assert result["grad_err"] <= 1e-5, f"rank {rank}: {result['grad_err']}"
