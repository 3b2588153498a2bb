"""What a checkpoint was written for, and the refusal of a resume into something else.

Each checkpoint ``pp-core run`` saves records, in the ``run`` section of its record
(:mod:`pp_core.checkpoint.record`), the model (``model.name`` or ``model.target``,
``model.args``), the optimizer and the pipeline layout (every degree: ``pp_size``,
``dp_replicate``, ``dp_shard``, ``tp_size``, ``ep_size``). A record that is there but malformed
(truncated, not JSON, the wrong shape) is refused naming it, never skipped.
:func:`check_resume_identity` compares a resume's checkpoint with the pipeline file before any
rank starts, by two means that do not depend on each other:

* the recorded identity (when there is one): a different model or ``model.args`` (other head
  counts, which change no parameter shape) or ``train.optimizer.name`` is refused naming the key;
  an argument naming a path is compared by what it resolves to (:mod:`pp_core.app.check.
  identity`: the config's content, the weights' digest), not by its string;
* DCP's own ``.metadata`` (every checkpoint has it): the parameter names and shapes against the
  model built on the meta device (a 4-layer checkpoint into a 2-layer model), and the names of
  the optimizer state against what ``train.optimizer`` keeps (``exp_avg`` or
  ``momentum_buffer``), so older checkpoints and ``model.target`` models are covered too.

A different pipeline layout is fine (the keys are parameter names): it gets a note.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pp_core.app.check.identity import resolved_paths
from pp_core.checkpoint.directory import check_dir, resume_checkpoint
from pp_core.checkpoint.record import RecordError, read_section
from pp_core.errors import PPCoreError, shorten
from pp_core.parallel.dims import ParallelDims

__all__ = ["run_identity", "check_resume_identity"]

DEGREES = tuple(ParallelDims.KEYS.values())
"""Every degree of the layout, as ``distributed`` names them; the identity records each."""


def run_identity(spec, fqns_per_stage=None) -> dict[str, Any]:
    """The identity of what ``spec`` trains (JSON-able): the record's ``run`` section."""
    dist = spec.distributed
    return {
        "model": {"name": spec.model.name, "target": spec.model.target,
                  "args": spec.model.args, "lora": spec.model.lora,  # the PEFT export reads it
                  "freeze": spec.model.freeze, "resolved": resolved_paths(spec.model.args)},
        "optimizer": spec.train.optimizer.get("name", "AdamW"),
        "layout": {**{degree: getattr(dist, degree) for degree in DEGREES},
                   "pp_schedule": spec.pipeline.pp_schedule, "fqns_per_stage": fqns_per_stage},
    }


def _recorded(path: Path) -> dict | None:
    """The recorded identity; ``None`` without one (an older pp-core); a malformed one
    (truncated, not JSON, the wrong shape) is a :class:`PPCoreError` naming its file."""
    try:
        return read_section(path, "run", _shape_problem)
    except RecordError as exc:
        raise PPCoreError(
            f"checkpoint.resume: {str(exc.file)!r} is malformed ({exc.why}); it records what the "
            f"checkpoint was written for, so it is not resumed without it: restore the file "
            f"(another step_NNNNNNNN directory has one), or delete it to resume without the "
            f"identity check") from None


def _shape_problem(value) -> str | None:
    """What is wrong with a parsed identity's shape, or ``None``."""
    if not isinstance(value, dict):
        return f"a JSON object expected, found {type(value).__name__}"
    model, layout = value.get("model"), value.get("layout", {})
    if not isinstance(model, dict) or not isinstance(model.get("args", {}), (dict, type(None))):
        return "'model' is not an object with 'name', 'target' and 'args'"
    if not all(isinstance(model.get(k), (str, type(None))) for k in ("name", "target")):
        return "'model.name' / 'model.target' are not strings"
    if not isinstance(value.get("optimizer"), (str, type(None))):
        return "'optimizer' is not a string"
    if not isinstance(layout, dict) or not all(
            isinstance(layout[k], int) for k in DEGREES if k in layout):
        return "'layout' is not an object of integer degrees"
    return None


def _compare_recorded(spec, path: Path, recorded: dict, problems: list[str],
                      notes: list[str]) -> None:
    mine = json.loads(json.dumps(run_identity(spec), default=str))
    where = f"checkpoint.resume: {str(path)!r} was written for"
    theirs, ours = recorded.get("model") or {}, mine["model"]
    for key in ("name", "target"):
        if theirs.get(key) != ours[key]:
            problems.append(f"model.{key}: {where} model.{key}={theirs.get(key)!r}, found "
                            f"{ours[key]!r}; resume with the model it was trained with")
            return
    args_then, args_now = theirs.get("args") or {}, ours["args"]
    then, now = theirs.get("resolved") or {}, ours.get("resolved") or {}
    changed = sorted(k for k in then if args_then.get(k) == args_now.get(k)
                     and then[k] != now.get(k))
    if changed:
        k = changed[0]
        problems.append(f"model.args.{k}: {where} model.args.{k}={args_now[k]!r} as it was "
                        f"then; it holds another model now (its config or weights changed "
                        f"since); resume with the model it was trained with")
        return
    differ = sorted(k for k in set(args_then) | set(args_now)
                    if args_then.get(k) != args_now.get(k)
                    and not (k in then and then[k] == now.get(k)))  # one content, two names
    if differ:
        shown = ", ".join(f"{k}: {args_then.get(k, '(unset)')!r} then, "
                          f"{args_now.get(k, '(unset)')!r} now" for k in differ[:4])
        problems.append(f"model.args.{differ[0]}: {where} other model.args ({shorten(shown, 300)}"
                        f"); resume with the arguments it was trained with")
    if recorded.get("optimizer") not in (None, mine["optimizer"]):
        problems.append(f"train.optimizer.name: {where} optimizer {recorded['optimizer']!r}, "
                        f"found {mine['optimizer']!r}; its optimizer state cannot be loaded into "
                        f"another optimizer: use {recorded['optimizer']!r}")
    layout = recorded.get("layout") or {}
    changed = [k for k in (*DEGREES, "pp_schedule")
               if k in layout and layout[k] != mine["layout"][k]]
    if changed:
        notes.append("checkpoint.resume: written with " + ", ".join(
            f"{k}={layout[k]!r}" for k in changed) + "; it loads into this layout by parameter "
            "name")


def _optimizer_state_names(spec) -> set[str] | None:
    """The per-parameter state ``train.optimizer`` keeps (one real step on one number)."""
    import torch  # lazy: only a resume pays for it

    options = dict(spec.train.optimizer)
    cls = getattr(torch.optim, str(options.pop("name", "AdamW")), None)
    if not isinstance(cls, type):
        return None
    param = torch.nn.Parameter(torch.zeros(1))
    try:
        optimizer = cls([param], **options)
        param.grad = torch.ones(1)
        optimizer.step()
    except Exception:  # noqa: BLE001 - preflight reports the optimizer's own problems
        return None
    return set(optimizer.state[param])


def _compare_metadata(spec, path: Path, metadata, model, problems: list[str]) -> None:
    stored = getattr(metadata, "state_dict_metadata", None) or {}
    if model is not None:
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        saved = {k[len("model."):]: tuple(getattr(v, "size", ()) or ())
                 for k, v in stored.items() if k.startswith("model.")}
        extra = sorted(set(saved) - set(expected))
        missing = sorted(set(expected) - set(saved))
        shapes = [k for k in expected if k in saved and saved[k] != expected[k]]
        why = None
        if extra:
            why = (f"holds {len(extra)} parameter(s) this model lacks ({', '.join(extra[:3])}"
                   f"{', ...' if len(extra) > 3 else ''})")
        elif missing:
            why = (f"lacks {len(missing)} of this model's parameter(s) "
                   f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        elif shapes:
            k = shapes[0]
            why = f"holds {k} of shape {list(saved[k])}, this model's is {list(expected[k])}"
        if why:
            problems.append(f"model.args: checkpoint.resume {str(path)!r} {why}: it was written "
                            f"for another model; resume with that model's model.args, or start "
                            f"fresh (checkpoint.resume: false)")
            return
    names = {k.rsplit(".", 1)[-1] for k in stored if k.startswith("optim.state.")}
    wanted = _optimizer_state_names(spec)
    if names and wanted is not None and names != wanted:
        problems.append(f"train.optimizer.name: checkpoint.resume {str(path)!r} holds optimizer "
                        f"state {sorted(names)}, but torch.optim."
                        f"{spec.train.optimizer.get('name', 'AdamW')} keeps {sorted(wanted)}: "
                        f"it was written by another optimizer; use that one")


def check_resume_identity(spec, model, problems: list[str], notes: list[str]) -> None:
    """Refuse a resume into another model or optimizer (see the module docstring)."""
    try:
        path = resume_checkpoint(spec.checkpoint.dir, spec.checkpoint.resume,
                                 spec.checkpoint.verify)
    except PPCoreError:
        return  # _check_resume reports it
    if path is None:
        return
    before = len(problems)
    try:
        recorded = _recorded(path)
    except PPCoreError as exc:
        problems.append(str(exc))
        return
    if recorded is not None:
        _compare_recorded(spec, path, recorded, problems, notes)
    if len(problems) == before:
        _compare_metadata(spec, path, check_dir(path), model, problems)
