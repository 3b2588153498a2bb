"""``ParallelDims``: the one value of every parallel degree - its figures, its problems (one line
each, naming the key), the spec's view of it, and ``build()`` laying out the mesh and the ep
groups on 4 gloo ranks. And the house rule: nothing else multiplies degrees or builds a mesh."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pp_core.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[2]


def test_figures():
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=3, tp=2, ep=3, sequence_parallel=True)
    assert (dims.dp, dims.world_size, dims.mesh_shape) == (6, 24, (2, 2, 3, 2))
    assert (dims.seq_len_divisor, dims.expert_dp) == (2, 2)
    assert dims.formula() == "pp_size * dp_size * tp_size"
    assert dims.formula(expanded=True) == "pp_size * dp_replicate * dp_shard * tp_size"
    assert dims.figures() == "2 * 6 * 2" and dims.figures(expanded=True) == "2 * 2 * 3 * 2"
    assert dims.describe() == "pp 2 x dp 6 x tp 2, ep 3"
    assert ParallelDims(pp=2).formula() == "pp_size * dp_size"  # tp named only above 1
    assert ParallelDims(pp=2, tp=1024).largest_key() == "tp_size"


def test_of_a_section_mapping_or_spec():
    assert ParallelDims.of({"pp_size": 2, "tp_size": 2}) == ParallelDims(pp=2, tp=2)
    assert ParallelDims.of({"pp_size": 2, "dp_size": 4}) == ParallelDims(pp=2, dp_replicate=4)
    from pp_core.app.spec import parse_spec

    spec = parse_spec({"model": {"name": "gpt"}, "data": {"name": "synthetic"},
                       "distributed": {"pp_size": 2, "dp_shard": 2, "tp_size": 2,
                                       "ep_size": 2}})
    assert spec.dims == ParallelDims(pp=2, dp_shard=2, tp=2, ep=2) == spec.distributed.dims
    assert spec.world_size == 8


def test_local_ranks():
    dims = ParallelDims(pp=2, dp_replicate=2, tp=2)
    assert dims.local_ranks(2, environ={}) == 4
    assert dims.local_ranks(1, nproc_per_node=3, environ={}) == 3
    assert dims.local_ranks(1, environ={"LOCAL_WORLD_SIZE": "5"}) == 5


def test_problems_name_the_key_and_the_fix():
    assert ParallelDims(pp=2, dp_replicate=2, ep=2).problems() == []
    assert ParallelDims(pp=2, dp_replicate=2, ep=3, tp=1, sequence_parallel=True).problems(
        nnodes=3) == [
        "distributed.ep_size: expected a divisor of the data-parallel size dp_replicate * "
        "dp_shard = 2, found 3; expert-parallel ranks are drawn from the dp ranks",
        "distributed.nnodes: pp_size * dp_size = 4 ranks cannot be shared evenly by nnodes=3; "
        "use an nnodes that divides 4",
        "distributed.sequence_parallel: shards activations over the tp ranks, found tp_size = "
        "1; set distributed.tp_size > 1 or drop sequence_parallel"]
    assert ParallelDims(pp=2, tp=2).problems(nnodes=2, nproc_per_node=3) == [
        "distributed.nproc_per_node: expected nnodes * nproc_per_node = pp_size * dp_size * "
        "tp_size = 4, found 2 * 3"]
    assert ParallelDims(pp=2, tp=2).world_size_problem(3, "torchrun started {} ranks") == (
        "torchrun started 3 ranks, but distributed.pp_size * dp_replicate * dp_shard * tp_size "
        "= 2 * 1 * 1 * 2 = 4")
    assert ParallelDims(pp=2, tp=2).world_size_problem(4) is None


def test_too_many_local_processes_names_tp_when_tp_is_the_large_degree():
    """It used to say ``distributed.dp_size: pp_size * dp_size / nnodes = 2 * 1 / 1 = 2,048``."""
    from pp_core.app.check.build import check_local_ranks
    from pp_core.app.spec import parse_spec

    spec = parse_spec({"model": {"name": "gpt"}, "data": {"name": "synthetic"},
                       "distributed": {"pp_size": 2, "tp_size": 1024}})
    problems: list[str] = []
    check_local_ranks(spec, problems)
    assert len(problems) == 1
    assert problems[0].startswith("distributed.tp_size: pp_size * dp_size * tp_size / nnodes = "
                                  "2 * 1 * 1024 / 1 = 2,048 processes on this machine"), problems


def _mesh_case(pp, replicate, shard, tp, ep):
    import torch.distributed as dist

    meshes = ParallelDims(pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp,
                          ep=ep).build("cpu")
    experts = meshes.experts
    return {"rank": dist.get_rank(), "names": meshes.mesh.mesh_dim_names,
            "pp": meshes.pp.size(), "dp": meshes.dp.size(), "tp": meshes.tp.size(),
            "pp_rank": meshes.pp_rank, "dp_rank": meshes.dp_rank,
            "engine": meshes.data_parallel_mesh().mesh_dim_names,
            "ep": None if experts is None else dist.get_process_group_ranks(experts.ep_group),
            "expert_dp": None if experts is None or experts.expert_dp_group is None else
            dist.get_process_group_ranks(experts.expert_dp_group)}


@pytest.mark.ranks
def test_build_lays_out_the_mesh_and_the_ep_groups_from_the_dp_ranks(pools):
    pool = pools(4)
    found = sorted(pool.run(_mesh_case, 2, 1, 2, 1, 2), key=lambda r: r["rank"])
    wide = sorted(pool.run(_mesh_case, 1, 2, 2, 1, 2), key=lambda r: r["rank"])
    assert [r["names"] for r in found] == [("pp", "dp_replicate", "dp_shard", "tp")] * 4
    assert [(r["pp"], r["dp"], r["tp"]) for r in found] == [(2, 2, 1)] * 4
    assert [(r["pp_rank"], r["dp_rank"]) for r in found] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["engine"] for r in found] == [("dp_shard",)] * 4
    assert [r["ep"] for r in found] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["expert_dp"] for r in found] == [None] * 4  # ep == dp: no expert-dp group
    assert [r["engine"] for r in wide] == [("dp_replicate", "dp_shard")] * 4  # HSDP
    assert [r["ep"] for r in wide] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["expert_dp"] for r in wide] == [[0, 2], [1, 3], [0, 2], [1, 3]]


# the house rule, counted from the source -----------------------------------------------------
_MESH_OR_GROUP = re.compile(r"init_device_mesh\(|new_group\(|DeviceMesh\(")
_WORLD_PRODUCT = re.compile(r"\b(pp|pp_size)\s*\*\s*(dp|dp_size|dist\.dp_size)\b.*\*\s*\w*tp")


def _sources():
    for path in sorted([*(ROOT / "pp_core").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def test_only_dims_builds_a_mesh_or_a_group():
    found = [f"{name}:{i}" for name, text in _sources()
             for i, line in enumerate(text.splitlines(), 1)
             if _MESH_OR_GROUP.search(line) and not line.lstrip().startswith(("#", "``"))]
    assert {f.split(":")[0] for f in found} == {"pp_core/parallel/dims.py"}, found


def test_only_dims_multiplies_the_degrees():
    found = [f"{name}:{i}: {line.strip()}" for name, text in _sources()
             for i, line in enumerate(text.splitlines(), 1)
             if _WORLD_PRODUCT.search(line) and name != "pp_core/parallel/dims.py"]
    assert found == [], found


@pytest.mark.cli
def test_spec_loading_imports_no_torch():
    code = ("import sys; import pp_core.app.spec, pp_core.parallel.dims; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


AUTO_EP = ("pipeline.pp_schedule: auto profiles each stage with all of its experts on one rank, "
           "so it cannot plan distributed.ep_size: 2 (each rank holding 1/2 of the experts and "
           "routing tokens by all-to-all); name a schedule (e.g. 1f1b), or plan at ep_size: 1 "
           "with 'pp-core plan' and run what it chose at ep_size: 2")


def test_auto_at_ep_above_one_is_refused_plainly():
    """The spec (validate, run) and plan_spec (``pp-core plan`` makes any file auto) say it with
    one message, before anything is profiled."""
    from pp_core.app.launch.decide import plan_spec
    from pp_core.app.spec import SpecError, parse_spec
    from pp_core.errors import ConfigError

    values = {"model": {"name": "moe_gpt"}, "data": {"name": "synthetic"},
              "pipeline": {"pp_schedule": "auto", "pp_batch_size": 4},
              "distributed": {"pp_size": 2, "dp_replicate": 2, "ep_size": 2}}
    with pytest.raises(SpecError) as error:
        parse_spec(values, "moe.yaml")
    assert str(error.value) == f"moe.yaml: {AUTO_EP}"
    values["pipeline"]["pp_schedule"] = "1f1b"
    with pytest.raises(ConfigError) as error:
        plan_spec(parse_spec(values, "moe.yaml"))
    assert str(error.value) == AUTO_EP
