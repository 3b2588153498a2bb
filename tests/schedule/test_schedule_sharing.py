"""Ranks sharing fewer processors than there are ranks: ``simulate(..., processors=P)``."""

import random

import pytest

from pp_core.devices import cpu_threads_per_rank, shared_processors
from pp_core.errors import ScheduleError
from pp_core.plugin_manager import default_plugins
from pp_core.schedule.build import build_schedule
from pp_core.schedule.sharing import replay_shared
from pp_core.schedule.simulate import Costs, simulate
from pp_core.schedule.validate import encode_validated

SIZES = ((2, 4), (3, 6), (4, 8))


def _cases():
    for name in sorted(entry.name for entry in default_plugins().schedules):
        for pp, m in SIZES:
            yield name, pp, m


def _schedule(name, pp, m):
    try:
        return build_schedule(name, num_ranks=pp, num_microbatches=m)
    except ScheduleError as exc:  # a schedule that refuses these sizes
        pytest.skip(str(exc))


def _random_costs(schedule, seed):
    rng = random.Random(seed)
    return Costs(per_stage={s: {k: rng.uniform(0.5, 2.0) for k in "FBIW"}
                            for s in range(schedule.num_stages)})


@pytest.mark.parametrize("name,pp,m", list(_cases()))
def test_a_processor_per_rank_replays_as_the_plain_simulation(name, pp, m):
    schedule = _schedule(name, pp, m)
    costs = _random_costs(schedule, pp * 100 + m)
    plain = simulate(schedule, costs, comm_latency=0.1)
    starts, ends = replay_shared(schedule, encode_validated(schedule, check_deadlock=False),
                                 costs.table(schedule.num_stages), 0.1, float(pp))
    assert [t for row in starts for t in row] == \
        pytest.approx([t for row in plain.starts for t in row])
    assert [row[-1] for row in ends] == pytest.approx(plain.last_end)
    assert simulate(schedule, costs, comm_latency=0.1, processors=pp + 1).makespan \
        == plain.makespan


@pytest.mark.parametrize("name,pp,m", list(_cases()))
def test_one_processor_runs_all_the_work_back_to_back(name, pp, m):
    schedule = _schedule(name, pp, m)
    costs = _random_costs(schedule, pp * 7 + m)
    one = simulate(schedule, costs, processors=1)
    # without latency some rank always has work, so one processor is never idle
    assert one.makespan == pytest.approx(sum(one.busy))


@pytest.mark.parametrize("name,pp,m", list(_cases()))
def test_sharing_is_bounded_by_the_plain_step_and_by_the_work_per_processor(name, pp, m):
    schedule = _schedule(name, pp, m)
    costs = _random_costs(schedule, pp + m)
    plain = simulate(schedule, costs, comm_latency=0.05)
    half = simulate(schedule, costs, comm_latency=0.05, processors=pp / 2)
    assert half.makespan >= plain.makespan - 1e-9
    assert half.makespan >= sum(half.busy) / (pp / 2) - 1e-9
    assert half.makespan <= sum(half.busy) + 0.05 * 2 * schedule.num_stages * m  # never worse
    for row in half.timeline:  # each rank's actions stay in order and do not overlap
        for (_, _, end), (_, start, _) in zip(row, row[1:]):
            assert start >= end - 1e-9


def test_a_hand_worked_case():
    """gpipe, 2 ranks, 2 microbatches, F=1, B=2, 1.5 processors:
    F(0,0) alone 0-1; F(0,1) and F(1,0) together at 0.75 speed: 1-2.333; F(1,1) alone
    -3.333; B(1,0) alone -5.333; B(0,0) and B(1,1) together: -8; B(0,1) alone: -10."""
    schedule = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    result = simulate(schedule, Costs(F=1, B=2), processors=1.5)
    assert result.makespan == pytest.approx(10.0)
    ends = [[end for _, _, end in row] for row in result.timeline]
    assert ends[0] == pytest.approx([1.0, 7 / 3, 8.0, 10.0])
    assert ends[1] == pytest.approx([7 / 3, 10 / 3, 16 / 3, 8.0])
    assert result.busy == pytest.approx([6.0, 6.0])


@pytest.mark.parametrize("bad", [0, -1, True, "2"])
def test_processors_must_be_a_positive_number(bad):
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="processors must be a number > 0"):
        simulate(schedule, processors=bad)


def test_what_a_pipeline_shares_of_a_machine():
    assert shared_processors(2, 1, 4, 4) == 2.0           # 4 one-thread ranks on 2 cores
    assert shared_processors(2, 1, 2, 2) is None          # one core each
    assert shared_processors(16, 4, 4, 4) is None         # 4 threads x 4 ranks on 16 cores
    assert shared_processors(8, 4, 4, 4) == 2.0           # 4 threads each, 8 cores
    assert shared_processors(2, 1, 8, 4) == 1.0           # pp 4 x dp 2 on 2 cores
    assert shared_processors(2, 1, 2, 4) is None          # a pipeline over two machines


def test_a_cpu_rank_gets_its_share_of_the_cores_or_omp_num_threads():
    assert cpu_threads_per_rank(1, {"OMP_NUM_THREADS": "3"}) == 3
    assert cpu_threads_per_rank(10 ** 6, {}) == 1
    assert cpu_threads_per_rank(1, {"OMP_NUM_THREADS": "x"}) >= 1


def test_the_cli_simulates_ranks_sharing_processors(capsys):
    import json

    from pp_core.app.cli import main

    figures = []
    for extra in (["--processors", "2"], []):
        assert main(["schedule", "simulate", "1f1b", "--pp", "4", "-m", "8", "--json",
                     *extra]) == 0
        figures.append(json.loads(capsys.readouterr().out))
    shared, own = figures
    assert shared["processors"] == 2 and own["processors"] is None
    assert shared["makespan"] == 51 and own["makespan"] == 33  # 4 x 24 busy / 2 + the fill
