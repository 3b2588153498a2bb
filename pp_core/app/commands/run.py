"""``pp-core run|validate|export``: run a YAML pipeline, check one, or export a checkpoint.

``run`` checks the whole file first (unknown keys, types, combinations, plugin names, the split
and the schedule), so a mistake is reported before any process starts; then it starts
``spec.dims.world_size`` ranks (``pp_size * dp_replicate * dp_shard * tp_size``) through torch's
launcher, or runs as one rank under ``torchrun``.

Every command module is imported to build the parser, so each command imports what it runs
inside its function: ``pp-core schedule ...`` and ``--help`` never pay for the spec machinery or
torch (``tests/schedule/test_schedule_torch_free.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pp_core.app.interrupts import Interrupted, exit_code
from pp_core.config import is_auto
from pp_core.errors import ConfigError

RUN_HELP = """\
Train the pipeline described in a YAML file (see docs/yaml.md).

On one machine pp-core starts pp_size x dp_size processes itself through
torch's launcher API, listening on 127.0.0.1 unless the file names another
address. On several machines run the same command on each one with
distributed.nnodes and a reachable distributed.master_addr/master_port, or let
torchrun start the processes (each then runs as one rank):

  torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29500 --rdzv-id job1 -m pp_core run pipe.yaml

A YAML 'module:attr' value (model.target, pipeline.loss_fn) imports and runs
that module's code: only run pipeline files you trust.
"""

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
    run = subparsers.add_parser("run", help="train a YAML pipeline", description=RUN_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("pipeline", metavar="PIPELINE.yaml", help="the pipeline file")
    run.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="KEY.PATH=VALUE", help=SET_HELP)
    run.add_argument("--memory-cap", metavar="SIZE",
                     help="with pipeline.pp_schedule: auto, the most memory a rank may use "
                          "(e.g. 8GiB); the fastest plan predicted to fit runs")
    run.set_defaults(func=run_command)

    validate = subparsers.add_parser(
        "validate", help="check a YAML pipeline without running it",
        description=VALIDATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    validate.add_argument("pipeline", metavar="PIPELINE.yaml")
    validate.add_argument("--set", dest="overrides", action="append", default=[],
                          metavar="KEY.PATH=VALUE", help=SET_HELP)
    validate.set_defaults(func=validate_command)

    export = subparsers.add_parser(
        "export", help="hand a checkpoint back: a state_dict file, a Hugging Face "
                       "directory or a PEFT adapter",
        description="Gather a pp-core checkpoint (any pipeline layout) with the model's own "
                    "parameter names into: one state_dict file (.pt, loadable with "
                    "torch.load(weights_only=True), or .safetensors); with --format hf a "
                    "save_pretrained directory (config, shards, index, tokenizer) that "
                    "from_pretrained loads; for a model.lora run the PEFT adapter directory "
                    "(--merge: the merged model).")
    export.add_argument("checkpoint", metavar="CKPT",
                        help="a step_NNNNNNNN directory, or a checkpoint.dir (its latest step)")
    export.add_argument("-o", "--output", required=True, metavar="FILE|DIR",
                        help="model.pt or model.safetensors; a directory with --format hf (or "
                             "--format safetensors and no suffix)")
    export.add_argument("--format", choices=("hf", "pt", "safetensors"), default=None,
                        help="hf: a save_pretrained directory (config, shards, index, "
                             "tokenizer); pt|safetensors: one state_dict file, or with a "
                             "directory -o the weights, index and YAML model section "
                             "(default: from -o's suffix)")
    export.add_argument("--max-shard-size", metavar="SIZE", default=None,
                        help="largest weight file of a directory export (default: "
                             "save_pretrained's)")
    export.add_argument("--dtype", default=None,
                        help="cast floating weights of a directory export (default: the "
                             "training dtype)")
    export.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip checking the checkpoint's files against the checksums "
                             "recorded when it was saved (checkpoint.verify: false)")
    export.add_argument("--merge", action="store_true",
                        help="with --format hf, a model.lora run: the merged model instead of "
                             "the PEFT adapter")
    export.set_defaults(func=export_command)


def _checked(args, warm: bool = False):
    """The file read and checked, and whether the ranks' imports began meanwhile: with ``warm``,
    a fork server (:mod:`pp_core.app.launch.warm`) once the file is read and ``sys.path``
    final."""
    from pp_core.app.check import preflight  # lazy: only when the command runs
    from pp_core.app.spec import load_spec

    spec = load_spec(args.pipeline, args.overrides)
    if warm:
        from pp_core.app.launch.warm import start  # lazy: only when `pp-core run` launches

        warm = start()
    return spec, preflight(spec), warm


def run_command(args) -> int:
    from pp_core.app.launch import launch, started_by_torchrun  # lazy: torch

    from pp_core.planning.sizes import parse_size

    cap = None if args.memory_cap is None else parse_size(args.memory_cap)
    spec, found, warm = _checked(args, warm=not started_by_torchrun())
    if cap is not None and not is_auto(spec.pipeline.pp_schedule):
        raise ConfigError(f"--memory-cap={args.memory_cap} only steers pipeline.pp_schedule: "
                          f"auto, and the file names {spec.pipeline.pp_schedule!r}; drop "
                          f"--memory-cap or set pp_schedule: auto")
    from torch.distributed.elastic.multiprocessing import SignalException  # lazy: torch

    from pp_core.app.commands.run_lock import run_locks  # lazy: only when a run starts

    try:
        taken: list[str] = []
        with run_locks(spec, taken):  # one writer per checkpoint.dir and output
            # the checks' notes ("m.jsonl exists and will be replaced") once this run holds its
            # outputs: a run another one refuses replaces nothing
            if not started_by_torchrun() or os.environ.get("RANK") == "0":  # not once per rank
                for note in found.notes:
                    print(f"pp-core: note: {note}", flush=True)
            for note in taken:
                print(f"pp-core: note: {note}", flush=True)
            launch(spec, announce=lambda line: print(f"pp-core: {line}", flush=True),
                   memory_cap=cap, warm=warm)
    except (KeyboardInterrupt, SignalException, Interrupted) as exc:
        reason, code = exit_code(exc)
        print(f"\npp-core: interrupted by {reason.name}; the ranks were stopped", file=sys.stderr)
        return code  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM
    return 0


def validate_command(args) -> int:
    from pp_core.app.rendezvous import resolve  # lazy: only when `pp-core validate` runs
    from pp_core.app.spec import SpecError

    os.environ[VALIDATING_ENV] = "1"  # plugins write no cache while they are checked
    try:
        spec, found, _ = _checked(args)
    finally:
        os.environ.pop(VALIDATING_ENV, None)
    if spec.distributed.nnodes == 1:  # then the rendezvous host is this machine
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


def export_command(args) -> int:
    from pp_core.checkpoint import export_checkpoint, latest_checkpoint  # lazy: DCP, seconds
    from pp_core.app.output_paths import refuse_export_collisions
    from pp_core.app.export.peft import lora_settings  # lazy: with the checkpoint to read

    source = Path(args.checkpoint)
    if not (source / ".metadata").is_file():
        latest = latest_checkpoint(source)
        if latest is not None:
            source = latest
    refuse_export_collisions(args.checkpoint, str(source), args.output)
    if args.merge or (args.format == "hf" and lora_settings(source) is not None):
        from pp_core.checkpoint.checksums import verify_checkpoint  # lazy: with an export
        from pp_core.app.export.peft import export_lora_command  # lazy: peft, transformers

        verify_checkpoint(source, args.verify)
        return export_lora_command(source, args)  # a model.lora run: PEFT's adapter directory
    if args.format is not None or args.dtype or args.max_shard_size:
        from pp_core.app.export.command import export_command as export_as  # lazy: DCP, seconds

        return export_as(source, args)
    output = export_checkpoint(source, args.output, verify=args.verify)
    print(f"wrote {output} from {source}")
    return 0
