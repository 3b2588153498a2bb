"""``distributed.layout: auto`` with ``nnodes: "MIN:MAX"``: one table of layouts, one per world
the run may be given, that every node and every restart uses.

Plans made from timings differ from one process to the next, and the nodes of a run must agree
on the layout. So the table (:func:`pp_core.app.plan.replan.plan_worlds`) is made once, by the
first node's launcher, and kept in ``checkpoint.dir`` (:data:`TABLE`, which every node of an
elastic run shares): another node's launcher, and a later launch of the same pipeline, read it
instead of measuring (a node that finds another planning waits for it: :data:`LOCK`). The
launcher gives the table to its ranks with the spec (``spec.prediction["layouts"]``), and each
rank takes the entry of the world the rendezvous gave it
(:func:`pp_core.app.elastic.fit_world`). The table is keyed by the pipeline it was planned for
(:func:`table_key`): a file of another pipeline's is planned again. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

from pp_core.app.elastic import apply_entry, worlds_of
from pp_core.errors import ConfigError

__all__ = ["TABLE", "LOCK", "table_key", "layouts_for", "planned_layouts"]

TABLE = ".pp_core_layouts.json"
LOCK = ".pp_core_layouts.lock"
NODE_KEYS = ("node_rank", "master_addr", "master_port", "rdzv_endpoint", "nproc_per_node")
"""The keys that differ between the nodes of one run (left out of :func:`table_key`)."""

Say = Callable[[str], None]


def table_key(spec) -> str:
    """What the table was planned for: the model, data, pipeline, degrees and activation
    checkpointing as the file gives them (not the node's own keys, nor the steps)."""
    values = spec.to_dict()
    distributed = {k: v for k, v in values["distributed"].items() if k not in NODE_KEYS}
    planned = {"model": values["model"], "data": values["data"],
               "pipeline": values["pipeline"], "distributed": distributed,
               "ac": values["train"]["activation_checkpointing"]}
    text = json.dumps(planned, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def layouts_for(spec, say: Say | None = None, memory_cap=None) -> dict:
    """The table of ``spec`` (``{str(world): entry}``): from ``checkpoint.dir`` when a launch
    of this pipeline planned it, else measured and planned here and kept there."""
    directory = Path(spec.checkpoint.dir)
    directory.mkdir(parents=True, exist_ok=True)
    key, path, lock = table_key(spec), directory / TABLE, directory / LOCK
    waited_since = None
    while True:
        found = _read(path, key)
        if found is not None:
            if say is not None:
                say(f"auto: the layouts planned for {', '.join(found)} ranks, from {path}")
            return found
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:  # another node is planning: its table is ours
            waited_since = waited_since or time.monotonic()
            if time.monotonic() - waited_since > spec.distributed.timeout_s:
                raise ConfigError(
                    f"distributed.layout: auto: another node has been planning the layouts for "
                    f"more than distributed.timeout_s = {spec.distributed.timeout_s} s ({lock} "
                    f"is there); remove {lock} if no node is planning") from None
            time.sleep(0.5)
    try:
        from pp_core.app.plan.replan import plan_worlds  # lazy: torch, the planner

        table = plan_worlds(spec, worlds_of(spec.distributed), memory_cap=memory_cap, say=say)
        staging = path.with_name(f"{TABLE}.tmp-{os.getpid()}")
        staging.write_text(json.dumps({"key": key, "layouts": table}), encoding="utf-8")
        os.replace(staging, path)
        return table
    finally:
        lock.unlink(missing_ok=True)


def _read(path: Path, key: str) -> dict | None:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or found.get("key") != key:
        return None  # another pipeline's table: planned again
    return found.get("layouts")


def planned_layouts(spec, say: Say | None = None, memory_cap=None):
    """What ``pp-core run`` starts for ``layout: auto`` on an elastic run: ``spec`` at the whole
    world's planned layout, with the table of every world's that a rank picks from after a
    shrink."""
    table = layouts_for(spec, say=say, memory_cap=memory_cap)
    planned = apply_entry(spec, table[str(spec.distributed.world_size)], table)
    if say is not None:
        chosen = planned.prediction
        say(f"auto: chose {chosen['layout']}, {chosen['schedule']}, microbatches of "
            f"{chosen['microbatch_size']} for {spec.distributed.world_size} ranks (predicted "
            f"step {chosen['predicted_step_s'] * 1e3:.1f} ms)")
    return planned
