"""LoRA through PEFT (``model.lora``) on the tiny GPT: every built-in schedule on 2 gloo ranks
equals the single-process PEFT model.

For each: the loss and every adapter gradient match the unsplit PEFT model over two SGD steps,
the base's parameters are unchanged bit for bit and have no ``.grad``, and the trained adapters
match. With adapters only in the later layers, the stages before them form a frozen prefix that
runs no backward and moves no gradient.
"""

from __future__ import annotations

import pytest

from tests.cases.frozen import check_frozen, frozen_case, parse
from tests.cases.runtime import SCHEDULES

NUM_RANKS = 2


pytestmark = pytest.mark.ranks(NUM_RANKS)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_lora_matches_the_single_process_peft_model(pool, schedule):
    results = pool.run(frozen_case, schedule, 2 * NUM_RANKS, kind="lora")
    check_frozen(results)
    trained = [n for r in results for n in r["trained"]]
    assert trained and all(".lora_" in n for n in trained), trained
    assert all(results[0]["trainable"])


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b", "v_schedule"])
def test_lora_with_the_receive_buffer_pool(pool, schedule):
    check_frozen(pool.run(frozen_case, schedule, 2 * NUM_RANKS, kind="lora", buffer_pool=True))


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_adapters_in_the_last_layers_leave_a_frozen_prefix(pool, schedule):
    """Adapters on layers 2 and 3 only: stage 0 (embeddings, layers 0-1) runs forwards alone."""
    results = pool.run(frozen_case, schedule, 2 * NUM_RANKS, kind="lora",
                       layers_to_transform=(2, 3))
    check_frozen(results)
    assert results[0]["trainable"] == (False, True)
    rank0 = {kind for _, kind, _ in map(parse, results[0]["actions"])}
    assert rank0 == {"F", "SEND_F"}, rank0
    assert [(r["sent"], r["received"]) for r in results] == [([], [])] * 2
