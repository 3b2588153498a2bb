"""One planning path: ``pp-core validate``, ``build_pipeline`` and the run summary plan alike.

They once planned separately and disagreed for CSV schedules (``stages_per_rank=None`` in one,
``num_stages // num_ranks`` in the other; a CSV with stages spread unevenly over the ranks was
refused by the two with different messages). Here a pipeline file is validated in this process
(on the meta device) and built on 2 gloo ranks (the real model); the split, the schedule and the
lowered program must be the same, and so must a refusal.
"""

from __future__ import annotations

import types

import pytest
import torch

from pp_core.app import cli
from pp_core.app.factories import model_factory
from pp_core.planning.plan import plan_pipeline
from pp_core.app.check import preflight
from pp_core.app.spec import SpecError, apply_overrides, parse_spec
from tests.cases.specs import tiny_gpt_spec

BASE = tiny_gpt_spec(model={"args": {"vocab_size": None}}, data={"args": {"vocab_size": None}},
                     train={"steps": 1}, output=None)
# rank 0 holds stages 0 and 2, rank 1 stage 1: valid as a schedule, but not an even split
UNEVEN_CSV = "0F0,,2F0,2B0,,0B0\n,1F0,,,1B0,\n"


pytestmark = pytest.mark.ranks(2, timeout=120)


def spec_of(overrides):
    return parse_spec(apply_overrides(BASE, overrides), "pipe.yaml")


def build_on_rank(overrides):
    """This rank's pipeline for the file: its plan, and the schedule the run summary reports."""
    import torch.distributed as dist

    from pp_core import build_pipeline
    from pp_core.app.rank.run_outputs import RunRecorder

    torch.set_num_threads(1)
    spec = spec_of(overrides)
    model = model_factory(spec)(**spec.model.args)
    try:
        pipe = build_pipeline(model, spec.pipeline, timeout=60)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    rank = dist.get_rank()
    ctx = types.SimpleNamespace(rank=rank, world_size=2, pp_rank=rank, dp_rank=0,
                                device=torch.device("cpu"))
    summary = RunRecorder(spec, ctx, pipe, num_params=0)._schedule()
    return {"rows": pipe.schedule.rows(), "stage_ranks": pipe.schedule.stage_ranks,
            "fqns": pipe.plan.split.fqns_per_stage, "stages": pipe.stage_indices,
            "program": str(pipe.program.rank(rank)), "summary_rows": summary.rows()}


def csv_file(tmp_path, name, *args):
    path = tmp_path / f"{name}.csv"
    cli.main(["schedule", "export", name, "--pp", "2", "-m", "4", *args, "-o", str(path)])
    return path


@pytest.mark.parametrize("case", ["1f1b", "interleaved_1f1b", "v_schedule", "csv:gpipe",
                                  "csv:interleaved_1f1b", "csv:v_schedule"])
def test_validate_build_and_summary_plan_alike(pool, tmp_path, case):
    if case.startswith("csv:"):
        name = case[4:]
        path = csv_file(tmp_path, name, *(["-v", "2"] if name == "interleaved_1f1b" else []))
        overrides = ("pipeline.pp_schedule=null", f"pipeline.pp_schedule_csv={path}")
    else:
        overrides = (f"pipeline.pp_schedule={case}",)
    validated = preflight(spec_of(overrides), run_checks=False)
    program = plan_pipeline(None, spec_of(overrides).pipeline, 2).program
    built = pool.run(build_on_rank, overrides)
    for rank, found in enumerate(built):
        assert found["rows"] == found["summary_rows"] == validated.schedule.rows(), rank
        assert found["stage_ranks"] == validated.schedule.stage_ranks
        assert found["fqns"] == validated.plan.fqns_per_stage
        assert found["stages"] == validated.schedule.stages_of(rank)
        assert found["program"] == str(program.rank(rank))
    assert validated.plan.num_stages == validated.schedule.num_stages == \
        (2 if case in ("1f1b", "csv:gpipe") else 4)


def test_a_csv_with_uneven_stages_is_refused_alike(pool, tmp_path):
    path = tmp_path / "uneven.csv"
    path.write_text(UNEVEN_CSV)
    overrides = ("pipeline.pp_schedule=null", f"pipeline.pp_schedule_csv={path}",
                 "pipeline.pp_microbatch_size=4")
    with pytest.raises(SpecError) as refused:
        preflight(spec_of(overrides), run_checks=False)
    [problem] = refused.value.problems
    expected = (f"the CSV schedule '{path}' places 3 stages on 2 ranks unevenly ([2, 1] per "
                f"rank); pp-core splits the model into the same number of stages on every rank, "
                f"so place 2 or 4 stages")
    assert problem.startswith(f"pipeline.pp_schedule_csv: {expected}"), problem
    for found in pool.run(build_on_rank, overrides):
        assert found == {"error": f"ConfigError: {expected}"}
