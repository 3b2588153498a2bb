"""pp-core and torch run each other's compute+comms programs, with one process's gradients.

* Every built-in schedule, exported by pp-core as a compute_comms CSV in the installed torch's
  dialect (2.15: with WAIT_SEND_F/WAIT_SEND_B/WAIT_REDUCE_GRAD), is loaded by torch's own
  ``_PipelineScheduleRuntime._load_csv(..., format="compute_comms")`` and takes a step there on
  2 and on 4 gloo ranks (m = 2 x ranks); loss and gradients equal the unsplit model's.
* Every schedule class torch has dumps its lowered program (``_dump_csv``, compute_comms);
  pp-core loads and validates it and runs it with ``pp_schedule_csv``, equal to one process.

Runs on the installed torch (CI: 2.13.0; ``bash scripts/test-torch.sh 2.15.0 THIS_FILE``).
"""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.cases.runtime import SCHEDULES, check, train_case
from tests.cases.torch_runtime import torch_comms_dump, torch_runtime_case

_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
# Every class that lowers its program (a new release's new ones included), and GPipe's order
# lowered by the runtime. (Schedule1F1B's _get_pipeline_order, a picture for torch's
# visualiser, is refused by torch's own validator, so torch cannot lower it.)
TORCH_CLASSES = ["ScheduleGPipe"] + sorted(
    name for name, cls in vars(_schedules).items()
    if isinstance(cls, type) and issubclass(cls, _schedules._PipelineScheduleRuntime)
    and cls is not _schedules._PipelineScheduleRuntime)
SIZES = [(2, 4), (4, 8)]


def exported(name: str, num_ranks: int, num_microbatches: int) -> str:
    from pp_core.schedule.build import build_schedule
    from pp_core.schedule.csv_io import format_comms_csv, installed_torch_version
    from pp_core.schedule.torch_comms import dialect_of

    schedule = build_schedule(name, num_ranks=num_ranks, num_microbatches=num_microbatches)
    return format_comms_csv(schedule, dialect_of(installed_torch_version()))


@pytest.mark.parametrize("num_ranks, num_microbatches", SIZES, ids=["pp2-m4", "pp4-m8"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_torch_loads_every_exported_schedule(name, num_ranks, num_microbatches):
    """Fast: torch's loader and (on 2.15) its send-wait validator accept every export."""
    from tests.cases.torch_runtime import torch_schedule
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from pp_core.schedule.csv_io import parse_csv

    text = exported(name, num_ranks, num_microbatches)
    ours = parse_csv(text)  # pp-core reads its own export back, communication checked
    runtime = torch_schedule(_PipelineScheduleRuntime, num_ranks, num_microbatches,
                             ours.num_stages // num_ranks)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ours.csv")
        with open(path, "w", newline="") as handle:
            handle.write(text)
        runtime._load_csv(path, format="compute_comms")
    assert [[str(a) for a in runtime.pipeline_order_with_comms[r]] for r in range(num_ranks)] \
        == [row.split(",") for row in text.splitlines()]


@pytest.mark.parametrize("num_ranks, num_microbatches", SIZES, ids=["pp2-m4", "pp4-m8"])
@pytest.mark.parametrize("cls", TORCH_CLASSES)
def test_torch_dumps_load_and_validate(tmp_path, cls, num_ranks, num_microbatches):
    from pp_core.schedule.csv_io import read_csv

    path = tmp_path / "torch.csv"
    torch_comms_dump(cls, num_ranks, num_microbatches, path)
    assert "SEND_F" in path.read_text()
    schedule = read_csv(path)
    assert schedule.num_ranks == num_ranks and schedule.num_microbatches == num_microbatches


# The pool is swapped once: every 2-rank case first, then every 4-rank case.
RUNS = [(way, name, num_ranks, m) for num_ranks, m in SIZES
        for way, names in (("pp-core export in torch", SCHEDULES), ("torch dump in pp-core",
                                                                     TORCH_CLASSES))
        for name in names]


@pytest.mark.parametrize("way, name, num_ranks, num_microbatches", RUNS,
                         ids=[f"{w.split()[0]}-{n}-pp{p}-m{m}" for w, n, p, m in RUNS])
def test_one_process_gradients(pools, tmp_path, way, name, num_ranks, num_microbatches):
    if way == "pp-core export in torch":
        text = exported(name, num_ranks, num_microbatches)
        results = pools(num_ranks).run(torch_runtime_case, text, num_microbatches)
    else:
        path = tmp_path / "torch.csv"
        torch_comms_dump(name, num_ranks, num_microbatches, path)
        results = pools(num_ranks).run(train_case, None, num_microbatches, False,
                                       csv_text=path.read_text())
    check(results, num_params=16)
