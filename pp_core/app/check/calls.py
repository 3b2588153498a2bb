"""The split computes the unsplit model's function: every module runs as often as unsplit.

``module_fqns_per_model_part`` (or a splitter) may put one module in two stages, e.g. ``layers.1``
in both: each stage then runs it, and the pipeline computes a function the unsplit model never
does (``layers.1`` applied twice), with no error anywhere. :func:`check_module_calls` runs one
microbatch through the unsplit meta model and through the stages' parts, chained as the runtime
chains them (stage ``s + 1`` called as ``forward(*outputs of s)``), counts with forward hooks how
often each module runs, and refuses a module with parameters that runs a different number of
times split than unsplit, naming it and the stages that run it.

What stays valid: a module without parameters (a shared ``rotary_emb``, a dropout) recomputes
the same values wherever it runs; a tied weight is held by two *different* modules (the
embedding and the head), each of which runs once. Modules on the path from the root to a kept
one run in every stage by construction and are not counted: only the modules a stage holds.
Nothing here needs values: on the meta device it costs a few milliseconds.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["check_module_calls"]


def _holds(fqns, name: str) -> bool:
    return any(name == fqn or name.startswith(fqn + ".") for fqn in fqns)


def _count_calls(module, held, run) -> Counter:
    """``{fqn: calls}`` of the modules of ``module`` that ``held(fqn)`` accepts, over ``run()``."""
    counts: Counter = Counter()
    handles = []
    for name, sub in module.named_modules(remove_duplicate=False):
        if name and held(name) and any(True for _ in sub.parameters()):
            handles.append(sub.register_forward_pre_hook(
                lambda _m, _a, _name=name: counts.update([_name])))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return counts


def _call(module, inputs, first: bool):
    if not first:
        return module(*inputs)
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


def _topmost(names) -> list[str]:
    """``names`` without those under another one of them (``layers.1``, not ``layers.1.attn``)."""
    ordered = sorted(names, key=lambda n: (n.count("."), n))
    kept: list[str] = []
    for name in ordered:
        if not any(name.startswith(k + ".") for k in kept):
            kept.append(name)
    return sorted(kept)


def module_call_counts(model, split, config, microbatch):
    """``(unsplit, per_stage)``: calls per module FQN unsplit, and per stage of ``split``;
    ``None`` where the meta device cannot run the model or a part (nothing to compare)."""
    import torch  # lazy: torch, only with a model in hand

    from pp_core.planning.parts import build_model_parts
    from pp_core.runtime.stage import as_outputs

    from pp_core.app.check.data import meta_friendly

    try:
        with torch.no_grad(), meta_friendly(model):
            unsplit = _count_calls(model, lambda _n: True,
                                   lambda: _call(model, microbatch, True))
            per_stage = []
            value = microbatch
            for stage in range(split.num_stages):
                (part,) = build_model_parts(model, split, [stage], config)
                fqns = split.fqns_per_stage[stage]
                outputs = {}

                def run(part=part, value=value, first=stage == 0):
                    outputs["value"] = _call(part, value, first)

                per_stage.append(_count_calls(part, lambda n, f=fqns: _holds(f, n), run))
                if stage < split.num_stages - 1:
                    value = as_outputs(outputs["value"], stage, config.dtype)
    except Exception:  # noqa: BLE001 - the meta device or the chain; the batch check reports it
        return None
    return unsplit, per_stage


def _first_microbatch(spec, model, batch):
    """The inputs of the first microbatch of dp rank 0, on the meta device (``None``: none)."""
    from pp_core.app.check.build import to_meta  # lazy: torch, only with a batch in hand
    from pp_core.app.factories import dp_slice
    from pp_core.runtime.microbatch import kwargs_chunk_dims

    try:
        pieces = spec.global_batch_size // spec.pipeline.pp_microbatch_size
        return to_meta(dp_slice(batch[0], 0, pieces, spec.global_batch_size,
                                kwargs_chunk_dims(model, batch[0])))
    except Exception:  # noqa: BLE001 - the batch check reports a batch that does not split
        return None


def check_module_calls(spec, model, split, batch, problems: list[str]) -> None:
    """Refuse a split in which a module with parameters runs a different number of times than
    in the unsplit model (see the module docstring); ``batch`` is the dataset's first."""
    if model is None or split is None or batch is None:
        return
    microbatch = _first_microbatch(spec, model, batch)
    config = spec.pipeline
    found = None if microbatch is None else module_call_counts(model, split, config, microbatch)
    if found is None:
        return
    unsplit, per_stage = found
    total: Counter = Counter()
    for counts in per_stage:
        total.update(counts)
    differ = _topmost(name for name in set(unsplit) | set(total) if unsplit[name] != total[name])
    for name in differ:
        stages = [s for s, counts in enumerate(per_stage) if counts[name]]
        where = (f"stages {', '.join(map(str, stages))} each run it" if len(stages) > 1 else
                 f"stage {stages[0]} runs it" if stages else "no stage runs it")
        listed = [s for s in range(split.num_stages) if _holds(split.fqns_per_stage[s], name)]
        fix = (f"list {name!r} in one stage only (it is in stages "
               f"{', '.join(map(str, listed))})" if len(listed) > 1 else
               "give each module to exactly one stage")
        key = "pipeline.module_fqns_per_model_part" if config.module_fqns_per_model_part \
            else "model.splitter"
        problems.append(
            f"{key}: module {name!r} runs {total[name]} time(s) "
            f"per microbatch in the split but {unsplit[name]} in the unsplit model ({where}), "
            f"so the pipeline would compute another function; {fix}")
