"""Shrink, and grow back (docs/failures.md): a run with ``distributed.nnodes: "1:2"`` goes on at a
smaller dp when a node is lost, with the losses of the whole world; the elastic keys' refusals.

Two launches of ``pp-core run`` on this machine are the two nodes (2 processes each, one c10d
rendezvous on loopback): pp 2 x dp 2 tiny GPT, a checkpoint every 4 steps. As step 7 begins on
node B, one of its ranks SIGKILLs B's whole process group (its agent and both ranks: the node is
gone). Node A's ranks fail, its agent re-forms the group alone, and its ranks go on at pp 2 x dp 1
from step 4 with twice the microbatches (the global batch kept), to rc 0 and the per-step losses
of the uninterrupted run at pp 2 x dp 2 (tests/app/conftest.py, shared with test_restarts).
With ``distributed.layout: auto`` one launch alone goes on at the layout planned for its world
(another pp and split) from that run's step-4 checkpoint, with its losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pp_core.app.spec import SpecError, parse_spec
from pp_core_builtins.models import GPT
from tests.cases.specs import ROOT, free_port, tiny_gpt_spec, write_spec

MICROBATCHES = 4  # forwards of one step on each rank at dp 2 (pp_batch_size 4 / microbatch 1)
_CALLS = [0]


class NodeKiller(GPT):
    """``PP_TEST_KILL_NODE=STEPS``: the first rank of this launch to begin step ``STEPS + 1``
    SIGKILLs its agent's process group, which is the launch's (the agent and every rank; under
    torchrun, whose ranks run in sessions of their own, the agent and then this rank)."""

    def forward(self, x):
        _CALLS[0] += 1
        steps = os.environ.get("PP_TEST_KILL_NODE")
        if steps and _CALLS[0] == int(steps) * MICROBATCHES + 1:
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return super().forward(x)


def _spec(tmp, name: str, **distributed) -> str:
    spec = tiny_gpt_spec(model={"name": None, "target": f"{__name__}:NodeKiller"},
                         distributed={"dp_size": 2, "device": "cpu", "max_restarts": 1,
                                      "timeout_s": 60, **distributed},
                         train={"steps": 8, "log_every": 1},
                         checkpoint={"dir": str(tmp / name), "every": 4},
                         output={"metrics": str(tmp / f"{name}.jsonl"), "progress": "plain",
                                 "summary": True})
    return str(write_spec(tmp / f"{name}.yaml", spec))


def _env(tmp, **extra) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "PP_CORE_TIMEOUT"}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp), **extra)
    return env


def _losses(path) -> dict[int, float]:
    """The last logged loss of every step."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


@pytest.mark.cli
@pytest.mark.ranks
def test_a_lost_node_leaves_the_survivor_going_on_at_a_smaller_dp_with_the_same_losses(
        tmp_path, uninterrupted_losses):
    port = free_port()
    path = _spec(tmp_path, "elastic", nnodes="1:2", master_port=port, elastic_wait_s=3)
    command = [sys.executable, "-m", "pp_core", "run", path]
    started = time.monotonic()
    node_a = subprocess.Popen(command, cwd=ROOT, env=_env(tmp_path), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # B waits for A's rendezvous store (node_rank 1 never hosts it): A survives B's loss
    node_b = subprocess.Popen([*command, "--set", "distributed.node_rank=1"], cwd=ROOT,
                              env=_env(tmp_path, PP_TEST_KILL_NODE="6"), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        b_out, b_err = node_b.communicate(timeout=180)
        a_out, a_err = node_a.communicate(timeout=180)
    finally:
        node_a.kill()
    print(f"both launches ended after {time.monotonic() - started:.1f} s")
    assert node_b.returncode == -signal.SIGKILL, b_err[-3000:]
    assert node_a.returncode == 0, a_err[-3000:]
    losses = _losses(tmp_path / "elastic.jsonl")
    assert sorted(losses) == list(range(1, 9))
    assert losses == pytest.approx(uninterrupted_losses, abs=1e-5, rel=0)
    assert "the rendezvous gave 2 of 4 ranks: going on at pp 2 x dp 1 (dp_replicate 2 -> 1; " \
           "pp_batch_size 4 -> 8 per replica, the global batch of 8 kept)" in a_out
    assert "resumed at step 4; steps 5..6 are done again" in a_out
    lines = [json.loads(line) for line in (tmp_path / "elastic.jsonl").read_text().splitlines()]
    restart = [line for line in lines if line.get("event") == "restart"]
    assert len(restart) == 1 and restart[0]["resumed_from"] == 4
    print(json.dumps({"recovery": restart[0]}))
    assert (tmp_path / "elastic" / "step_00000008" / ".metadata").is_file()


_ELASTIC = {"nnodes": "1:2", "dp_size": 2, "master_port": 29500}


@pytest.mark.parametrize("distributed, checkpoint, message", [
    ({**_ELASTIC, "dp_size": 1, "pp_size": 4}, {"dir": "c"},
     "distributed.nnodes: '1:2' may leave 1 node(s) x 2 process(es) = 2 ranks, fewer than one "
     "pipeline replica needs (pp_size x tp_size x ep_size = 4); raise MIN to 2"),
    (_ELASTIC, {},
     "distributed.nnodes: '1:2' lets the run go on with fewer nodes from the latest "
     "checkpoint, found checkpoint.dir unset (nothing to go on from); add checkpoint.dir: "
     "<path>"),
    (_ELASTIC, {"dir": "c"},
     "distributed.nnodes: '1:2' goes on without a lost node by restarting the others, found "
     "distributed.max_restarts: 0; set distributed.max_restarts: N (the failures the run "
     "survives)"),
    ({**_ELASTIC, "nnodes": "1:4", "dp_size": 4, "max_restarts": 1}, {"dir": "c"},
     "distributed.nnodes: '1:4' may leave 3 node(s) x 2 process(es) = 6 ranks, whose dp 3 "
     "cannot share the global batch of 16 samples (pipeline.pp_batch_size x dp = 4 x 4) in "
     "whole microbatches of pp_microbatch_size 1; choose a MIN:MAX whose every node count "
     "does, or other degrees"),
])
def test_elastic_nnodes_is_refused_before_start_where_it_could_not_go_on(distributed, checkpoint,
                                                                         message):
    with pytest.raises(SpecError) as found:
        parse_spec(tiny_gpt_spec(distributed=distributed, checkpoint=checkpoint))
    assert found.value.problems == [message]


def test_a_world_that_cannot_hold_one_replica_ends_the_run_with_one_message():
    """What a rank raises when the rendezvous (torchrun's, with other --nproc-per-node) gave a
    world below one pipeline replica; and the layout it takes at one that holds whole ones."""
    from pp_core.app.elastic import fit_world
    from pp_core.errors import PipelineError

    spec = parse_spec(tiny_gpt_spec(distributed={**_ELASTIC, "dp_shard": 2, "dp_size": 1,
                                                 "max_restarts": 1}, checkpoint={"dir": "c"}))
    with pytest.raises(PipelineError) as found:
        fit_world(spec, 1)
    assert str(found.value) == (
        "distributed.nnodes: '1:2': the rendezvous gave 1 rank(s), which cannot hold whole "
        "pipeline replicas of pp_size x tp_size x ep_size = 2 ranks; the run ends here: start "
        "it again once enough nodes are back (it resumes from the latest checkpoint with "
        "checkpoint.resume: true)")
    fitted, note = fit_world(spec, 2)  # FSDP alone: dp_shard follows the world
    assert (fitted.dims.dp_shard, fitted.dims.dp_replicate, fitted.global_batch_size) == (1, 1, 8)
    assert note == ("the rendezvous gave 2 of 4 ranks: going on at pp 2 x dp 1 (dp_shard 2 -> "
                    "1; pp_batch_size 4 -> 8 per replica, the global batch of 8 kept)")
    assert fit_world(spec, 4) == (spec, None)


@pytest.mark.cli
@pytest.mark.ranks
def test_layout_auto_re_plans_the_whole_layout_for_the_world_it_is_given(
        tmp_path, uninterrupted_run, uninterrupted_losses):
    """``distributed.layout: auto`` with ``nnodes: "1:2"`` (world_size 4): the layouts of 4 and
    of 2 ranks are planned from one measurement (here in-process, tp 1, no link: ~2 s) and kept
    in checkpoint.dir, where a launch finds them, as a second node or a relaunch does. One launch
    alone (the other node never comes) goes on at the layout planned for 2 ranks - another pp
    and split than the uninterrupted pp 2 x dp 2 run's - from that run's step-4 checkpoint,
    resharded onto it through DCP, with its losses."""
    from pp_core.app.elastic import worlds_of
    from pp_core.app.elastic_layouts import TABLE, table_key
    from pp_core.app.plan.replan import plan_worlds

    spec = tiny_gpt_spec(distributed={"nnodes": "1:2", "world_size": 4, "layout": "auto",
                                      "dp_size": 2, "device": "cpu", "max_restarts": 1,
                                      "timeout_s": 60, "master_port": free_port(),
                                      "elastic_wait_s": 1},
                         train={"steps": 8, "log_every": 1},
                         checkpoint={"dir": str(tmp_path / "auto"), "every": 4,
                                     "resume": str(uninterrupted_run / "ckpt" / "step_00000004")},
                         output={"metrics": str(tmp_path / "auto.jsonl"), "progress": "plain",
                                 "summary": True})
    parsed = parse_spec(spec)
    table = plan_worlds(parsed, worlds_of(parsed.distributed), measure_link=False,
                        fixed={"tp_size": 1})
    (tmp_path / "auto").mkdir()
    (tmp_path / "auto" / TABLE).write_text(json.dumps({"key": table_key(parsed),
                                                       "layouts": table}))
    at_two = table["2"]
    result = subprocess.run([sys.executable, "-m", "pp_core", "run",
                             str(write_spec(tmp_path / "auto.yaml", spec))], cwd=ROOT,
                            env=_env(tmp_path), text=True, capture_output=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"auto: the layouts planned for 4, 2 ranks, from {tmp_path / 'auto' / TABLE}" \
        in result.stdout
    planned = at_two["prediction"]
    assert (f"the rendezvous gave 2 of 4 ranks: re-planned for 2 (distributed.layout: auto): "
            f"going on at {planned['layout']}, {planned['schedule']}, microbatches of "
            f"{planned['microbatch_size']} (pp_batch_size {table['4']['pipeline']['pp_batch_size']}"
            f" -> {at_two['pipeline']['pp_batch_size']} per replica, the global batch of 8 "
            f"kept;") in result.stdout
    assert f"  auto plan: {planned['layout']}, {planned['schedule']}" in result.stdout
    losses = _losses(tmp_path / "auto.jsonl")
    assert sorted(losses) == [5, 6, 7, 8]
    reference = {step: uninterrupted_losses[step] for step in losses}
    assert losses == pytest.approx(reference, abs=1e-5, rel=0)


def test_layout_auto_on_an_elastic_run_is_checked_by_its_world_size():
    """With ``layout: auto`` the written degrees are not the run's: no refit refusal from them;
    the world must be MAX nodes x nproc_per_node, and a rank given a world nothing was planned
    for ends the run with one message."""
    from pp_core.app.elastic import fit_world
    from pp_core.errors import PipelineError

    auto = {**_ELASTIC, "layout": "auto", "max_restarts": 1, "pp_size": 4, "dp_size": 1}
    spec = parse_spec(tiny_gpt_spec(distributed={**auto, "world_size": 4},
                                    checkpoint={"dir": "c"}))
    with pytest.raises(SpecError) as found:
        parse_spec(tiny_gpt_spec(distributed={**auto, "world_size": 5}, checkpoint={"dir": "c"}))
    assert found.value.problems == [
        "distributed.world_size: 5 processes are not 2 node(s) (MAX of nnodes '1:2') x 2 "
        "process(es); use a world_size that is MAX x nproc_per_node"]
    with pytest.raises(PipelineError) as found:
        fit_world(spec, 3)
    assert str(found.value) == (
        "distributed.layout: auto: the rendezvous gave 3 rank(s), a world no layout was planned "
        "for at launch (planned: none); start every node with the same nproc_per_node")


def test_layout_auto_waits_for_the_node_that_plans_at_most_timeout_s(tmp_path):
    """A launch that finds another node planning (its lock in checkpoint.dir) waits for its
    table, and after distributed.timeout_s names the lock to remove (a node that died planning)."""
    from pp_core.app.elastic_layouts import LOCK, layouts_for
    from pp_core.errors import ConfigError

    spec = parse_spec(tiny_gpt_spec(distributed={**_ELASTIC, "layout": "auto", "world_size": 4,
                                                 "max_restarts": 1, "timeout_s": 1},
                                    checkpoint={"dir": str(tmp_path)}))
    (tmp_path / LOCK).touch()
    with pytest.raises(ConfigError) as found:
        layouts_for(spec)
    assert str(found.value) == (
        f"distributed.layout: auto: another node has been planning the layouts for more than "
        f"distributed.timeout_s = 1 s ({tmp_path / LOCK} is there); remove {tmp_path / LOCK} if "
        f"no node is planning")
