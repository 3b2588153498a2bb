"""``pp-core validate FILE``: a pipeline file checked without starting a process.

Everything ``run`` checks before it starts a rank (:func:`load_checked`, which ``run`` shares),
then a summary of what would run: the ranks and batch, the split, the simulated schedule, the
runtime initializers, activation checkpointing and compile.
"""

from __future__ import annotations

import argparse
import os

from pp_core.errors import ConfigError

__all__ = ["register", "validate_command", "load_checked", "VALIDATING_ENV", "SET_HELP"]

VALIDATE_HELP = """\
Check a pipeline file without starting a process: every key, the plugins it
names, the model split (planned on the meta device, no memory), the schedule
for these sizes, and what each rank would build: the datasets and one batch,
the optimizer, the resume path and every output path (nothing is written).

validate imports and calls the code the file names: model.target is called
with model.args, and a 'module:attr' loss_fn runs on one microbatch. Only
validate pipeline files you trust.
"""

VALIDATING_ENV = "PP_CORE_VALIDATING"
"""Set while ``validate`` builds what a rank builds: a plugin's cache (``tokenized_text``'s token
cache) is read, never written (docs/yaml.md)."""

SET_HELP = ("override a key, e.g. --set train.steps=10 --set pipeline.pp_schedule=gpipe "
            "(the value is parsed as YAML; repeatable)")


def register(subparsers) -> None:
    validate = subparsers.add_parser(
        "validate", help="check a YAML pipeline without running it",
        description=VALIDATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    validate.add_argument("pipeline", metavar="PIPELINE.yaml")
    validate.add_argument("--set", dest="overrides", action="append", default=[],
                          metavar="KEY.PATH=VALUE", help=SET_HELP)
    validate.set_defaults(func=validate_command)


def load_checked(args, once_read=None):
    """The spec of ``args.pipeline`` (with ``--set``) and what :func:`~pp_core.app.check.preflight`
    found in it; a problem is one :class:`~pp_core.app.spec.SpecError`. ``once_read()`` is called
    when the file is read and before it is checked (``run`` starts its ranks' imports then)."""
    from pp_core.app.check import preflight  # lazy: only when the command runs
    from pp_core.app.spec import load_spec

    spec = load_spec(args.pipeline, args.overrides)
    if once_read is not None:
        once_read()
    return spec, preflight(spec)


def validate_command(args) -> int:
    from pp_core.app.rendezvous import resolve  # lazy: only when `pp-core validate` runs
    from pp_core.app.spec import SpecError

    os.environ[VALIDATING_ENV] = "1"  # plugins write no cache while they are checked
    try:
        spec, found = load_checked(args)
    finally:
        os.environ.pop(VALIDATING_ENV, None)
    if spec.distributed.max_nodes == 1:  # then the rendezvous host is this machine
        try:
            resolve(spec.distributed)
        except ConfigError as exc:
            raise SpecError([str(exc)], spec.source) from None
    dist, pipeline = spec.distributed, spec.pipeline
    print(f"{spec.source}: ok")
    print(f"  model {spec.model.name or spec.model.target}, data {spec.data.name}, "
          f"loss {pipeline.loss_fn}")
    print(f"  {spec.world_size} ranks: {spec.dims.describe()}; global batch "
          f"{spec.global_batch_size} = {pipeline.pp_batch_size} per pipeline x "
          f"{dist.dp_size}, {spec.pipeline.num_microbatches} microbatches of "
          f"{pipeline.pp_microbatch_size}")
    if found.plan is not None:
        print("  split: " + found.plan.describe().replace("\n", "\n  "))
    if found.schedule is not None:
        from pp_core.schedule.simulate import Costs, simulate  # lazy: only when validate runs

        from pp_core.schedule.frozen import describe_frozen, frozen_costs  # lazy: as above

        costs = frozen_costs(Costs(), found.schedule.num_stages, found.trainable)
        result = simulate(found.schedule, costs)
        print(f"  schedule {found.schedule.name}: {found.schedule.num_stages} stages, "
              f"simulated bubble {100 * result.bubble_ratio:.1f}% at unit costs, peak "
              f"activations per rank {result.peak_activations}")
        if found.trainable is not None and not all(found.trainable):
            print(f"  frozen: {describe_frozen(found.trainable)}")
    if found.initializers is not None:
        print("  " + _initializers(found.initializers).replace("\n", "\n  "))
    print(f"  {_parallelisms(spec)}")
    from pp_core.app.commands.run_lock import holders  # lazy: only when `pp-core validate` runs

    for note in found.notes + holders(spec):
        print(f"  note: {note}")
    return 0


def _initializers(per_stage) -> str:
    """``runtime initializers:`` then, per stage, each key, its signature and how many modules
    share it (what the executor prepares before each microbatch)."""
    if not any(per_stage):
        return "runtime initializers: none"
    lines = ["runtime initializers (prepared before each microbatch):"]
    for stage, found in enumerate(per_stage):
        shown = "; ".join(f"key {key!r}, signature {signature!r}, {count} module"
                          f"{'' if count == 1 else 's'}" for key, signature, count in found)
        lines.append(f"  stage {stage}: {shown or 'none'}")
    return "\n".join(lines)


def _parallelisms(spec) -> str:
    """``activation checkpointing full (every block), compile on (mode default)``."""
    ac, compiled = spec.train.activation_checkpointing, spec.train.compile
    every = "every block" if ac["every"] == 1 else f"every {ac['every']}th block"
    text = "activation checkpointing " + ("off" if ac["mode"] == "none" else
                                          f"{ac['mode']} ({every})")
    options = ", ".join(f"{k} {v}" for k, v in compiled.items() if k != "enabled")
    text += ", compile " + (f"on ({options or 'torch defaults'})" if compiled["enabled"]
                            else "off")
    return text + "; with the schedule: supported (docs/activation_and_compile.md)"
