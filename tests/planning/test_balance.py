"""The cost balancer: optimal against brute force, its edge cases and errors, and the split by
a measured profile (pure, no process group)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from pp_core import ConfigError
from pp_core.planning.balance import balance, split_by_profile, unit_costs
from pp_core.planning.costs import ModelProfile, UnitCost
from pp_core.planning.partition import balanced_partition


def max_stage_cost(costs, counts):
    bounds = [0, *itertools.accumulate(counts)]
    return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def brute_force(costs, stages):
    n = len(costs)
    return min(max_stage_cost(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))])
               for cuts in itertools.combinations(range(1, n), stages - 1))


def check(costs, stages):
    counts = balance(costs, stages)
    assert len(counts) == stages and all(c >= 1 for c in counts) and sum(counts) == len(costs)
    # exact, up to the rounding of float sums (0.1 + 0.1 + 0.1 is not 0.3)
    best = brute_force(costs, stages)
    assert max_stage_cost(costs, counts) == pytest.approx(best, rel=1e-12, abs=1e-15), \
        (costs, stages, counts)
    return counts


def test_float_costs_are_optimal_on_every_small_case():
    rng = random.Random(15)
    for n in range(1, 10):
        for stages in range(1, min(n, 5) + 1):
            for _ in range(25):
                kind = rng.random()
                if kind < 0.4:  # measured seconds: no two alike
                    costs = [rng.uniform(1e-4, 5e-2) for _ in range(n)]
                elif kind < 0.7:  # a heavy embedding and head around light blocks
                    costs = [rng.uniform(0.01, 0.1) for _ in range(n)]
                    costs[0], costs[-1] = rng.uniform(0.5, 1.0), rng.uniform(0.5, 1.0)
                else:  # ties and zeros
                    costs = [rng.choice([0.0, 0.1, 0.3, 1.0]) for _ in range(n)]
                check(costs, stages)


def test_int_costs_are_optimal_and_the_partition_helper_is_the_same_function():
    assert balanced_partition is balance
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, min(n, 5))
        check([rng.choice([0, 1, 5, 9, 30]) for _ in range(n)], stages)


def test_edge_cases():
    assert balance([3.0], 1) == [1]
    assert balance([1, 2, 3], 3) == [1, 1, 1]           # as many stages as units
    assert balance([0, 0, 0, 0], 2) == [3, 1]           # all free: earlier stages filled first
    assert balance([5, 0, 0, 5], 2) == [3, 1]           # a free unit stays with the one before
    assert balance([1e-9, 1.0, 1e-9], 2) in ([2, 1], [1, 2])
    assert balance([10.0, 1.0, 1.0, 1.0, 1.0, 10.0], 3) == [1, 4, 1]   # heavy ends alone


@pytest.mark.parametrize("costs, stages, match", [
    ([1.0, 2.0], 3, "cannot split 2 units into 3 non-empty stages; use at most 2"),
    ([], 1, "cannot split 0 units"),
    ([1.0], 0, "num_stages=0 must be a positive int"),
    ([1.0, -2.0], 1, "finite numbers >= 0, got \\[-2.0\\]"),
    ([1.0, float("nan")], 1, "finite numbers >= 0"),
    ([1.0, True], 1, "finite numbers >= 0"),
])
def test_errors(costs, stages, match):
    with pytest.raises(ConfigError, match=match):
        balance(costs, stages)


def unit(fqns, forward, backward, **sizes):
    return UnitCost(tuple(fqns), forward, backward, backward / 2, backward / 2,
                    sizes.get("act", 10), sizes.get("params", 100), sizes.get("out", 8))


def profile(*units, shared=()):
    return ModelProfile(2, tuple(units), 1e-5, 1e9, shared_fqns=tuple(shared))


def test_split_by_profile_balances_forward_plus_backward_and_keeps_ends_in_place():
    """Shared modules (a rotary table) are left to the splitter that builds the parts."""
    prof = profile(unit(["tok_embeddings"], 0.3, 0.7),
                   *[unit([f"layers.{i}"], 0.1, 0.2) for i in range(6)],
                   unit(["norm", "output"], 0.3, 0.7), shared=["rope"])
    assert unit_costs(prof) == pytest.approx([1.0] + [0.3] * 6 + [1.0])
    stages = split_by_profile(prof, 4)
    assert stages == [["tok_embeddings"], ["layers.0", "layers.1", "layers.2"],
                      ["layers.3", "layers.4", "layers.5"], ["norm", "output"]]
    # forward only: the same here, costs are proportional
    assert split_by_profile(prof, 4, kind="eval") == stages
    # 8 virtual stages of 8 units: one unit each, in stage order
    assert [s[0] for s in split_by_profile(prof, 8)][::7] == ["tok_embeddings", "norm"]


def test_split_by_profile_errors():
    with pytest.raises(ConfigError, match="kind='bogus': expected one of 'train', 'eval'"):
        split_by_profile(profile(unit(["a"], 1, 1)), 1, kind="bogus")
    with pytest.raises(ConfigError, match="no units; profile the model"):
        split_by_profile(profile(), 1)
    with pytest.raises(ConfigError, match="cannot split 1 units into 2"):
        split_by_profile(profile(unit(["a"], 1, 1)), 2)


def test_profile_round_trips_through_json():
    prof = profile(unit(["embed"], 0.1, 0.2), unit(["layers.0", "layers.1"], 0.3, 0.4),
                   shared=["rotary"])
    again = ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again == prof
    with pytest.raises(ValueError, match="unknown keys \\['speed'\\]"):
        ModelProfile.from_dict({**prof.to_dict(), "speed": 1})
