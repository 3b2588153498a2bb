"""A pipeline file as ``pp-core schedule``'s NAME: its schedule and sizes fill the flags.

Read as YAML alone (no model built, no torch imported: the schedule commands stay torch-free,
``tests/schedule/test_schedule_torch_free.py``).
"""

from __future__ import annotations

from pathlib import Path

from pp_core.app.spec.yaml import YamlProblem, read_yaml
from pp_core.config import is_auto
from pp_core.errors import ScheduleError


def fill_from_pipeline_file(args) -> None:
    """NAME is a pipeline file: its schedule (or CSV), pp_size, microbatches (pp_batch_size /
    pp_microbatch_size) and stages per rank (of its FQN lists) fill the flags not given. Read as
    YAML alone: the schedule commands import no torch, and the model is not built."""
    source = args.name
    try:
        data = read_yaml(Path(source).read_bytes()) or {}
    except (OSError, YamlProblem) as exc:
        raise ScheduleError(f"{source}: {getattr(exc, 'strerror', None) or exc}") from None
    sections = data if isinstance(data, dict) else {}
    pipeline, dist = (sections.get(k) if isinstance(sections.get(k), dict) else {}
                      for k in ("pipeline", "distributed"))
    csv, args.name = pipeline.get("pp_schedule_csv"), pipeline.get("pp_schedule") or "1f1b"
    if csv:
        beside = Path(source).parent / str(csv)  # as the run reads it: relative to the file
        args.csv, args.name = (str(beside) if beside.is_file() else str(csv)), None
    elif is_auto(args.name):
        raise ScheduleError(f"{source}: pipeline.pp_schedule: auto is chosen when the run starts; "
                            f"'pp-core plan {source}' shows the choice")
    if args.pp is None:
        args.pp = dist.get("pp_size", 1)
    if args.seq_chunks is None and isinstance(pipeline.get("pp_seq_chunks"), int):
        args.seq_chunks = pipeline["pp_seq_chunks"]
    if args.microbatches is None:
        batch, micro = pipeline.get("pp_batch_size") or 1, pipeline.get("pp_microbatch_size") or 1
        args.microbatches = batch // micro if isinstance(batch, int) and isinstance(micro, int) \
            and micro > 0 else batch
    fqns = pipeline.get("module_fqns_per_model_part")
    if args.stages_per_rank is None and isinstance(fqns, list) and isinstance(args.pp, int) \
            and args.pp > 0 and len(fqns) > args.pp:
        args.stages_per_rank = len(fqns) // args.pp
