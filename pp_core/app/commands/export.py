"""``pp-core export CKPT -o OUT``: a checkpoint's weights handed back, whatever layout wrote it.

The one place that decides what an export writes, from the flags and the checkpoint's record:

* a ``model.lora`` run with ``--format hf``: the PEFT adapter directory, or with ``--merge`` the
  merged model (:mod:`pp_core.app.export.peft`);
* ``--format hf``: a ``save_pretrained`` directory (:func:`~pp_core.app.export.hf.
  export_hf_directory`);
* ``--format safetensors`` (or ``--dtype`` / ``--max-shard-size``) with ``-o DIR``, no suffix:
  the directory form of any model (:func:`~pp_core.app.export.hf.export_directory_form`);
* otherwise one ``state_dict`` file, ``.pt`` or ``.safetensors``
  (:func:`pp_core.checkpoint.export_checkpoint`).

The checkpoint's files are checked against their checksums once, before its record is read.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pp_core.errors import ConfigError

__all__ = ["register", "export_command"]

HELP = """\
Write a pp-core checkpoint's weights (any pipeline layout) for the tools that
come next, under the model's own parameter names:

  --format hf               a save_pretrained directory (config, safetensors
                            shards + index, tokenizer files when known); for a
                            model.lora run the PEFT adapter, or with --merge the
                            merged model
  --format safetensors -o DIR
                            the directory form of any model: weights, index and
                            the YAML model section that rebuilds it
  -o model.pt | model.safetensors
                            one state_dict file (torch.load(weights_only=True)
                            reads the .pt)
"""


def register(subparsers) -> None:
    export = subparsers.add_parser(
        "export", help="write a checkpoint's weights: a save_pretrained directory, a PEFT "
                       "adapter, or one state_dict file",
        description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def _dtype(value):
    if value is None:
        return None
    from pp_core.config import resolve_dtype  # lazy: torch

    try:
        dtype = resolve_dtype(value)
    except Exception:  # noqa: BLE001 - its message is rewritten for the flag
        dtype = None
    if dtype is None or not dtype.is_floating_point:
        raise ConfigError(f"--dtype {value!r}: expected a floating dtype such as float32, "
                          f"bfloat16 or float16")
    return dtype


def _size(value):
    if value is None:
        return None
    from pp_core.planning.sizes import parse_size  # lazy: only with the flag

    return parse_size(value, what="--max-shard-size")


def _source(given: Path) -> Path:
    """The checkpoint ``CKPT`` names: itself, or the latest in a ``checkpoint.dir``."""
    from pp_core.checkpoint import latest_checkpoint  # lazy: DCP, seconds

    if not (given / ".metadata").is_file():
        latest = latest_checkpoint(given)
        if latest is not None:
            return latest
    return given


def _run_reads(source: Path) -> dict:
    """The model and data sections of the run ``source`` was saved by, as recorded: the paths
    it read, which ``-o`` must not write over (an unreadable record: none; the checksums and
    the record's own check refuse it next)."""
    from pp_core.app.export.described import recorded_export  # lazy: with the command
    from pp_core.checkpoint.record import read_section
    from pp_core.errors import PPCoreError

    try:
        record = recorded_export(source)
        run = read_section(source, "run") or {}
    except PPCoreError:
        return {}
    return {"model": {**(record.get("model") or {}), **(run.get("model") or {})},
            "data": record.get("data") or {}}


def _writer(args, output: Path):
    """What the flags ask for: ``"hf"`` (a Hugging Face directory, or a LoRA run's adapter),
    ``"directory"`` (the directory form) or ``"file"`` (one ``state_dict`` file); a
    contradiction is one :class:`ConfigError` before the checkpoint is read."""
    fmt, sized = args.format, bool(args.dtype or args.max_shard_size)
    if args.merge and fmt != "hf":
        raise ConfigError("--merge writes a Hugging Face directory; add --format hf")
    if fmt == "hf":
        return "hf"
    if (fmt or sized) and fmt != "pt" and output.suffix not in (".pt", ".safetensors"):
        return "directory"
    if sized:
        raise ConfigError("--dtype and --max-shard-size apply to directory exports; add "
                          "--format hf, or give -o a directory with --format safetensors")
    if fmt is not None and output.suffix != f".{fmt}":
        raise ConfigError(f"--format {fmt} writes a .{fmt} file, -o names {str(output)!r}; name "
                          f"it model.{fmt}, or export a directory with --format hf / --format "
                          f"safetensors -o DIR")
    return "file"


def _hf_writer(args, source: Path, options: dict):
    """The writer of ``--format hf`` for this checkpoint, and its keyword arguments: the PEFT
    adapter (or ``--merge``: the merged model) when its record holds ``model.lora``."""
    from pp_core.app.export import hf, peft  # lazy: torch, transformers

    lora = peft.lora_settings(source)
    if lora is None and args.merge:
        raise ConfigError(f"--merge merges LoRA adapters, and {str(source)!r} records no "
                          f"model.lora; drop --merge")
    if lora is None:
        return hf.export_hf_directory, options
    if args.dtype or args.max_shard_size:
        raise ConfigError("--dtype and --max-shard-size do not apply to a model.lora run's "
                          "export; drop them")
    return (peft.export_merged if args.merge else peft.export_peft_adapter), {"section": lora}


def export_command(args) -> int:
    from pp_core.app.output_paths import refuse_export_collisions  # lazy: with the command
    from pp_core.checkpoint import export_checkpoint  # lazy: DCP, seconds
    from pp_core.checkpoint.directory import check_dir

    source, output = _source(Path(args.checkpoint)), Path(args.output)
    kind = _writer(args, output)
    refuse_export_collisions(args.checkpoint, str(source), args.output,  # before any work
                             None if kind == "file" else "directory", _run_reads(source))
    options = {"dtype": _dtype(args.dtype), "max_shard_size": _size(args.max_shard_size)}
    check_dir(source, args.verify)  # whole and as written before its record is read; once
    if kind == "file":
        print(f"wrote {export_checkpoint(source, output, verify=args.verify)} from {source}")
        return 0
    if kind == "hf":
        write, options = _hf_writer(args, source, options)
    else:
        from pp_core.app.export.hf import export_directory_form  # lazy: torch

        write = export_directory_form
    from pp_core.app.export.staging import staged_directory  # lazy: with a directory export

    started = time.perf_counter()
    with staged_directory(output, "-o") as staging:
        write(source, staging, verify=args.verify, **options)
    written = output
    files = sorted(p.name for p in written.iterdir() if not p.name.startswith("."))
    print(f"wrote {written} from {source} in {time.perf_counter() - started:.1f} s: "
          f"{', '.join(files)}")
    return 0
