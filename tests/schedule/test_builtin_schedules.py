"""The built-in schedule plugins (``pp_core_builtins.schedules.*``): registration, names, docstring
pictures, which sizes each admits, validity of every admitted size, and the reference's figures.

Every order is checked by :func:`pp_core.schedule.build.build_schedule`, which validates it
(placement, completeness, local order, deadlock freedom by list scheduling). Action-for-action
agreement with the reference's worked examples is in ``test_schedule_examples.py``.
"""

import ast
import importlib
import inspect
import re

import pytest

from pp_core import ScheduleDef, ScheduleError
from pp_core.schedule.build import build_schedule
from pp_core.schedule.ir import format_actions
from pp_core.schedule.simulate import simulate
from pp_core.testing import plugins_with

# module -> (schedule name, placement, default stages per rank, variable stages per rank)
SCHEDULES = {
    "gpipe": ("gpipe", "loop", 1, False),
    "one_f_one_b": ("1f1b", "loop", 1, False),
    "interleaved_1f1b": ("interleaved_1f1b", "loop", 2, True),
    "looped_bfs": ("looped_bfs", "loop", 2, True),
    "dfs": ("dfs", "loop", 2, True),
    "zero_bubble": ("zero_bubble", "loop", 1, True),
    "zb_h2": ("zb_h2", "loop", 1, False),
    "v_schedule": ("v_schedule", "v", 2, False),
    "v_half": ("v_half", "v", 2, False),
    "v_min": ("v_min", "v", 2, False),
    "dualpipe_v": ("dualpipe_v", "v", 2, False),
}
NAMES = [spec[0] for spec in SCHEDULES.values()]
TORCH_NAMES = {
    "GPipe": "gpipe", "ScheduleGPipe": "gpipe", "1F1B": "1f1b", "Schedule1F1B": "1f1b",
    "Interleaved1F1B": "interleaved_1f1b", "ScheduleInterleaved1F1B": "interleaved_1f1b",
    "LoopedBFS": "looped_bfs", "ScheduleLoopedBFS": "looped_bfs", "DFS": "dfs",
    "InterleavedZeroBubble": "zero_bubble", "ScheduleInterleavedZeroBubble": "zero_bubble",
    "ZB_H1": "zero_bubble", "zbh1": "zero_bubble", "ZB_H2": "zb_h2",
    "ZBVZeroBubble": "v_schedule", "ScheduleZBVZeroBubble": "v_schedule", "zbv": "v_schedule",
    "DualPipeV": "dualpipe_v", "ScheduleDualPipeV": "dualpipe_v", "V_Half": "v_half",
    "v_min": "v_min",
}


@pytest.fixture(scope="module")
def plugins():
    return plugins_with(*(f"pp_core_builtins.schedules.{module}" for module in SCHEDULES))


def build(plugins, name, p, m, v=None):
    return build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=v,
                          plugins=plugins)


def admitted(name: str, p: int, m: int, v: int) -> bool:
    """Which microbatch counts each algorithm admits (the rules in each plugin's docstring)."""
    if name == "interleaved_1f1b" or (name == "zero_bubble" and v > 1):
        return m % max(1, m // p) == 0  # torch's automatic group size N = m // (m // p)
    if name == "dfs":
        return m % p == 0  # Megatron's groups of p
    if name == "dualpipe_v":
        return m >= 2 * p
    return True


# ----------------------------------------------------------------------------- registration


@pytest.mark.parametrize("module", list(SCHEDULES))
def test_each_module_registers_one_schedule_with_its_shape(module):
    name, placement, stages_per_rank, variable = SCHEDULES[module]
    plugin = importlib.import_module(f"pp_core_builtins.schedules.{module}")
    registry = plugins_with(f"pp_core_builtins.schedules.{module}").schedules
    assert registry.names() == [name]
    sdef = registry.get(name)
    assert isinstance(sdef, ScheduleDef)
    assert (sdef.placement, sdef.stages_per_rank, sdef.variable_stages_per_rank) == (
        placement, stages_per_rank, variable)
    assert sdef.description
    # One public generator, named after the schedule module, is what the plugin registers.
    assert plugin.__all__ == [module] and sdef.generate is getattr(plugin, module)
    assert list(inspect.signature(sdef.generate).parameters) == [
        "num_stages", "num_microbatches", "num_ranks"]


def test_all_names_and_aliases_coexist_and_resolve_case_insensitively(plugins):
    registry = plugins.schedules  # building it raises PluginError on any duplicate alias
    assert sorted(registry.names()) == sorted(NAMES)
    for alias, name in TORCH_NAMES.items():
        assert registry.entry(alias).name == name, alias
        assert registry.entry(alias.upper()).name == name, alias


@pytest.mark.parametrize("module", list(SCHEDULES))
def test_docstring_picture_is_the_generated_order(module):
    plugin = importlib.import_module(f"pp_core_builtins.schedules.{module}")
    doc = plugin.__doc__
    head = re.search(r"num_ranks=(\d+), num_stages=(\d+), num_microbatches=(\d+)\n", doc)
    assert head, f"{module}'s docstring has no 'num_ranks=.., num_stages=.., ...' picture"
    p, s, m = map(int, head.groups())
    pictured = re.findall(r"^ *rank (\d+): (.*)$", doc[head.end():], flags=re.M)
    generated = getattr(plugin, module)(s, m, p)
    assert pictured == [(str(r), format_actions(row)) for r, row in enumerate(generated)]


@pytest.mark.parametrize("module", list(SCHEDULES))
def test_modules_are_small_and_import_only_top_level_pp_core(module):
    plugin = importlib.import_module(f"pp_core_builtins.schedules.{module}")
    source = inspect.getsource(plugin)
    assert len(source.splitlines()) <= 150
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    # Schedules that share an engine import it from a private module of the package.
    allowed = {"pp_core", "collections", "heapq", "pp_core_builtins.schedules._controllable_memory",
               "pp_core_builtins.schedules._interleaved"}
    assert imported <= allowed


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("name", NAMES)
def test_every_admitted_size_builds_a_valid_schedule_and_others_are_refused(plugins, name, p):
    _, _, default_v, variable = next(s for s in SCHEDULES.values() if s[0] == name)
    for v in ((default_v, 2, 3) if variable else (default_v,)):
        for m in range(1, 3 * p + 3):
            if admitted(name, p, m, v):
                schedule = build(plugins, name, p, m, v)  # validated: complete, deadlock free
                assert schedule.num_stages == p * v
                continue
            with pytest.raises(ScheduleError, match="nearest valid: ") as refused:
                build(plugins, name, p, m, v)
            nearest = re.search(r"nearest valid: (\d+)(?: or (\d+))?", str(refused.value))
            counts = [int(c) for c in nearest.groups() if c]
            assert all(admitted(name, p, c, v) for c in counts), (name, p, m, v, counts)
            assert not any(admitted(name, p, c, v) for c in range(min(counts) + 1, max(counts)))


@pytest.mark.parametrize("name, p, m, v, message", [
    ("interleaved_1f1b", 4, 9, 2, r"multiple of max\(1, num_microbatches // num_ranks\).*"
                                  r"nearest valid: 8 or 10"),
    ("interleaved_1f1b", 4, 13, 3, r"nearest valid: 12 or 15"),
    ("zero_bubble", 4, 11, 2, r"nearest valid: 10 or 12"),
    ("dfs", 4, 6, 2, r"multiple of num_ranks=4.*nearest valid: 4 or 8"),
    ("dfs", 4, 3, 2, r"nearest valid: 4\b"),
    ("dualpipe_v", 4, 7, 2, r"num_microbatches >= 2 \* num_ranks = 8.*nearest valid: 8"),
    ("interleaved_1f1b", 4, 8, 1, r"stages per rank.*'1f1b'"),
    ("dfs", 4, 8, 1, r"stages per rank.*'1f1b'"),
    ("looped_bfs", 4, 8, 1, r"stages per rank.*'gpipe'"),
])
def test_refusals_name_the_constraint_and_the_fix(plugins, name, p, m, v, message):
    with pytest.raises(ScheduleError, match=message):
        build(plugins, name, p, m, v)


@pytest.mark.parametrize("name, default", [(name, v) for name, _, v, variable in
                                           SCHEDULES.values() if not variable])
def test_build_schedule_refuses_a_stage_count_that_does_not_fit_the_placement(plugins, name,
                                                                              default):
    """The sizes every generator may assume are checked once, by build_schedule."""
    other = 3 - default  # 1 <-> 2
    with pytest.raises(ScheduleError, match=rf"^schedule '{name}' runs exactly {default} "
                                            rf"stage\(s\) per rank, got stages_per_rank={other}; "
                                            rf"set stages_per_rank={default}"):
        build(plugins, name, 4, 8, other)
    with pytest.raises(ScheduleError, match=r"^num_microbatches must be an integer >= 1, got 0"):
        build(plugins, name, 4, 0)


@pytest.mark.parametrize("name", NAMES)
def test_large_pipeline_builds(plugins, name):
    schedule = build(plugins, name, 16, 64)  # validated: complete and deadlock free
    assert schedule.num_microbatches == 64 and schedule.num_stages in (16, 32)


# ----------------------------------------------------------------------------- orders


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_dfs_is_interleaved_1f1b_when_p_divides_m(plugins, p, v):
    for m in (p, 2 * p, 3 * p):
        assert build(plugins, "dfs", p, m, v).rows() == \
            build(plugins, "interleaved_1f1b", p, m, v).rows()


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zero_bubble_with_one_stage_per_rank_is_zb_h1(plugins, p):
    """Reference 5.6, written out: warm-up p-1-r, then F / I / W lagging r steps."""
    for m in range(1, 3 * p + 3):
        expected = []
        for r in range(p):
            w = p - 1 - r
            row = [f"{r}F{k}" for k in range(min(w, m))]
            for j in range(m):
                row += [f"{r}F{j + w}"] if j + w < m else []
                row += [f"{r}I{j}"] + ([f"{r}W{j - r}"] if j >= r else [])
            expected.append(" ".join(row + [f"{r}W{k}" for k in range(max(0, m - r), m)]))
        assert build(plugins, "zero_bubble", p, m).rows() == expected


@pytest.mark.parametrize("module", ["v_half", "v_min"])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 12])
def test_controllable_memory_repeats_its_stable_phase_exactly(module, p):
    """Beyond 2p+8 microbatches the stable phase is repeated; it must equal computing it all."""
    from pp_core_builtins.schedules._controllable_memory import controllable_memory_orders

    block = importlib.import_module(f"pp_core_builtins.schedules.{module}")._block(p)
    for m in (2 * p + 9, 2 * p + 10, 3 * p + 15):
        assert controllable_memory_orders(block, m) == \
            controllable_memory_orders(block, m, repeat_after=m)


# torch class -> (our name, stages per rank to try). torch 2.13's Schedule1F1B IR gives its last
# rank the forwards F1..Fm (its runtime loop is right), so that rank is not compared.
TORCH_CLASSES = {
    "GPipe": ("gpipe", (1,)), "1F1B": ("1f1b", (1,)),
    "Interleaved1F1B": ("interleaved_1f1b", (2, 3)), "LoopedBFS": ("looped_bfs", (2, 3)),
    "InterleavedZeroBubble": ("zero_bubble", (2, 3)), "ZBVZeroBubble": ("v_schedule", (2,)),
    "DualPipeV": ("dualpipe_v", (2,)),
}


@pytest.mark.parametrize("torch_name", list(TORCH_CLASSES))
def test_orders_match_torch_pipeline_order(plugins, torch_name):
    """Our order equals the ``pipeline_order`` torch builds (idle cells, REDUCE_GRAD dropped,
    OVERLAP_F_B pairs as their halves); torch refuses exactly the sizes we refuse, except that
    1f1b also takes m < p."""
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    name, vs = TORCH_CLASSES[torch_name]

    def cells(action):
        subs = getattr(action, "sub_actions", None) or ()
        if subs:
            return [cell for sub in subs for cell in cells(sub)]
        return [str(action)] if re.fullmatch(r"\d+[FBIW]\d+", str(action)) else []

    for p, ms in ((3, (1, 2, 5, 6, 7)), (4, (1, 3, 4, 6, 8, 9, 10, 12))):
        for v in vs:
            for m in ms:
                try:
                    ops = vis.get_schedule_ops(torch_name, p, m, num_stages_per_rank=v)
                except Exception:  # torch refuses this size (ValueError or AssertionError)
                    if name != "1f1b":
                        with pytest.raises(ScheduleError):
                            build(plugins, name, p, m, v)
                    continue
                theirs = [" ".join(c for a in row if a is not None for c in cells(a))
                          for row in ops]
                ours = build(plugins, name, p, m, v).rows()
                if name == "1f1b":
                    theirs, ours = theirs[:-1], ours[:-1]
                assert ours == theirs, (torch_name, p, v, m)


# ----------------------------------------------------------------------------- figures

# (name, p, m, v) -> (makespan, bubble, span bubble, peak per rank), unit costs F=I=W=1, B=2:
# the published bubble table (docs/schedules.md), and its p=8, m=32 bubbles (span and peaks from
# its formulas).
SECTION_4 = {
    ("gpipe", 4, 8, 1): (33, 9, 9, [8, 8, 8, 8]),
    ("1f1b", 4, 8, 1): (33, 9, 9, [4, 3, 2, 1]),
    ("interleaved_1f1b", 4, 8, 2): (57, 9, 9, [11, 9, 7, 5]),
    ("looped_bfs", 4, 8, 2): (57, 9, 9, [16, 16, 16, 16]),
    ("zero_bubble", 4, 8, 1): (27, 3, 3, [4, 4, 4, 4]),
    ("zb_h2", 4, 8, 1): (27, 3, 0, [7, 7, 7, 7]),
    ("zero_bubble", 4, 8, 2): (51, 3, 3, [8, 8, 8, 8]),
    ("v_schedule", 4, 8, 2): (51, 3, 0, [8, 8, 8, 8]),
    ("v_half", 4, 8, 2): (53, 5, 5, [6, 6, 6, 6]),
    ("v_min", 4, 8, 2): (59, 11, 11, [4, 4, 4, 4]),
    # DualPipeV: its overlapped pairs run as two actions (see test_schedule_examples.py), so the
    # figure is not the reference's composite "no overlap" 54/6; peaks are its 2p+1.
    ("dualpipe_v", 4, 8, 2): (51, 3, 3, [9, 9, 9, 9]),
    ("1f1b", 4, 16, 1): (57, 9, 9, [4, 3, 2, 1]),
    ("interleaved_1f1b", 4, 16, 2): (105, 9, 9, [11, 9, 7, 5]),
    ("zero_bubble", 4, 16, 2): (99, 3, 3, [8, 8, 8, 8]),
    ("v_schedule", 4, 16, 2): (99, 3, 0, [8, 8, 8, 8]),
    ("v_half", 4, 16, 2): (101, 5, 5, [6] * 4),
    ("v_min", 4, 16, 2): (107, 11, 11, [4] * 4),
    ("1f1b", 8, 32, 1): (None, 21, 21, [8, 7, 6, 5, 4, 3, 2, 1]),
    ("interleaved_1f1b", 8, 32, 2): (None, 21, 21, [23, 21, 19, 17, 15, 13, 11, 9]),
    ("zero_bubble", 8, 32, 1): (None, 7, 7, [8] * 8),
    ("zero_bubble", 8, 32, 2): (None, 7, 7, [16] * 8),
    ("v_schedule", 8, 32, 2): (None, 7, 0, [16] * 8),
    ("v_half", 8, 32, 2): (None, 17, None, 10),  # an int: the peak of the busiest rank
    ("v_min", 8, 32, 2): (None, 27, None, 8),
    ("dualpipe_v", 8, 32, 2): (None, 7, 7, [17] * 8),
}


@pytest.mark.parametrize("key", list(SECTION_4), ids=lambda k: "{}-p{}-m{}-v{}".format(*k))
def test_unit_cost_figures_match_the_reference_table(plugins, key):
    name, p, m, v = key
    makespan, bubble, span, peaks = SECTION_4[key]
    sim = simulate(build(plugins, name, p, m, v))
    assert sim.bubble == bubble
    if isinstance(peaks, int):
        assert max(sim.peak_activations) == peaks
    else:
        assert sim.peak_activations == peaks
    if makespan is not None:
        assert sim.makespan == makespan
    if span is not None:
        assert sim.span_bubble == span


@pytest.mark.parametrize("name, peak", [("v_half", lambda p: 2 * ((p + 2) // 2)),
                                        ("v_min", lambda p: 2 * ((p + 4) // 3)),
                                        ("v_schedule", lambda p: 2 * p),
                                        ("zb_h2", lambda p: 2 * p - 1)])
@pytest.mark.parametrize("p", range(2, 9))
def test_peak_memory_is_the_schedule_bound(plugins, name, peak, p):
    for m in (1, p, 3 * p):
        assert max(simulate(build(plugins, name, p, m)).peak_activations) <= peak(p)
    assert max(simulate(build(plugins, name, p, 3 * p)).peak_activations) == peak(p)
