"""The frozen-stage pass on schedules, programs, the simulator and the auto planner (pure)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pp_core.planning.choose import choose_plan
from pp_core.schedule.build import build_schedule
from pp_core.schedule.frozen import (backward_from, describe_frozen, frozen_costs, frozen_table,
                                     without_frozen)
from pp_core.schedule.ir import B, I, W
from pp_core.schedule.lower import lower
from pp_core.schedule.simulate import Costs, simulate
from tests.cases.profiles import PROFILES



def kinds(program, rank):
    return [str(a) for a in program.rank(rank).actions]


def test_a_frozen_prefix_loses_its_backward_and_its_gradient_messages():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    trainable = (False, True)
    program = lower(without_frozen(schedule, trainable), backward_from(trainable))
    assert kinds(program, 0) == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0F2", "0SEND_F2"]
    assert kinds(program, 1) == ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1RECV_F2", "1F1", "1B1",
                                 "1F2", "1B2"]
    # the activation stage 1 received is still what its weight gradient reads, until its B
    assert [lt.released for lt in program.rank(1).recv_lifetimes] == [3, 6, 8]


def test_a_later_frozen_stage_keeps_its_input_gradient_and_drops_w():
    schedule = build_schedule("zero_bubble", num_ranks=2, num_microbatches=4)
    trained = without_frozen(schedule, (True, False))
    rows = [[a for a in row if a is not None] for row in trained.actions]
    assert not [a for a in rows[1] if a.kind in (I, W)]
    assert sum(a.kind is B for a in rows[1]) == 4
    assert sum(a.kind is W for a in rows[0]) == 4  # stage 0 still trains, after its I
    program = lower(trained)
    assert sum("SEND_B" in str(a) for a in program.rank(1).actions) == 4


def test_every_stage_training_leaves_the_schedule_alone():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    assert without_frozen(schedule, None) is schedule
    assert without_frozen(schedule, (True, True)) is schedule
    assert describe_frozen((True, True)) == "every stage trains"
    assert describe_frozen((False, False, True, False)) == \
        "stages 0..1 frozen: no backward; stages [3] without trainable parameters: no W"


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble", "interleaved_1f1b", "v_schedule"])
def test_frozen_costs_make_the_simulated_step_shorter(name):
    schedule = build_schedule(name, num_ranks=2, num_microbatches=4)
    n = schedule.num_stages
    trainable = tuple(s >= n // 2 for s in range(n))
    full = simulate(schedule, Costs()).makespan
    frozen = simulate(schedule, frozen_costs(Costs(), n, trainable)).makespan
    assert frozen < full
    table = frozen_table(Costs().table(n), trainable)
    assert table[0] == (1.0, 0.0, 0.0, 0.0) and table[n // 2] == (1.0, 1.0, 0.0, 1.0)
    assert frozen_table([(1, 2, 1, 1)] * 2, (True, False))[1] == (1.0, 1.0, 1.0, 0.0)


def lora_profile(profile, frozen_units: int):
    """The profile of a LoRA run: adapters make W and the trained bytes tiny; the first
    ``frozen_units`` units hold no adapter at all."""
    units = []
    for index, unit in enumerate(profile.units):
        frozen = index < frozen_units
        weight = 0.0 if frozen else unit.weight_grad_s * 0.02
        units.append(replace(unit, weight_grad_s=weight, backward_s=unit.input_grad_s + weight,
                             trainable_param_bytes=0 if frozen else unit.param_bytes // 100))
    return replace(profile, units=tuple(units))


def test_auto_picks_another_plan_for_lora_than_for_full_fine_tuning():
    full = choose_plan(PROFILES, 2, 8)
    lora = choose_plan({m: lora_profile(p, 4) for m, p in PROFILES.items()}, 2, 8)
    assert lora.chosen.predicted_step_s < 0.5 * full.chosen.predicted_step_s
    assert lora.chosen.option != full.chosen.option
    rank_memory = lora.chosen.memory[0]
    assert rank_memory.grads < rank_memory.params / 50  # adapters only: no frozen gradients


def test_schedule_simulate_takes_frozen_stages(capsys):
    from pp_core.app import cli

    assert cli.main(["schedule", "simulate", "zero_bubble", "--pp", "2", "-m", "8", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert cli.main(["schedule", "simulate", "zero_bubble", "--pp", "2", "-m", "8", "--json",
                     "--frozen", "0"]) == 0
    frozen = json.loads(capsys.readouterr().out)
    assert (full["makespan"], frozen["makespan"]) == (25, 17)
    assert cli.main(["schedule", "simulate", "1f1b", "--pp", "2", "-m", "4", "--frozen",
                     "2"]) == 1
    assert "--frozen '2': expected stage indices 0..1" in capsys.readouterr().err


def test_schedule_export_takes_frozen_stages(capsys):
    """``schedule export --frozen`` writes the program a LoRA run executes (issue #48, item 2):
    it used to ignore ``--frozen`` and export the full fine-tune's."""
    from pp_core.app import cli

    argv = ["schedule", "export", "1f1b", "--pp", "2", "-m", "2"]
    assert cli.main(argv + ["--frozen", "0"]) == 0
    assert capsys.readouterr().out == "0F0,0F1\r\n1F0,1B0,1F1,1B1\r\n"
    assert cli.main(argv + ["--frozen", "0", "--format", "compute_comms", "--torch", "2.13"]) == 0
    assert capsys.readouterr().out == (
        "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RESHARD\r\n"  # no backward, no RECV_B
        "1RECV_F0,1UNSHARD,1F0,1RECV_F1,1B0,1F1,1B1,1REDUCE_GRAD,1RESHARD\r\n")  # no SEND_B
