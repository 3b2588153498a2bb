"""``pp-core export CKPT --format hf|pt|safetensors [--dtype D] [--max-shard-size S] -o OUT``.

``--format hf`` writes a ``save_pretrained`` directory; ``safetensors`` with ``-o DIR`` (no
``.safetensors`` suffix) the directory form of any model; ``pt`` / ``safetensors`` with a file
name the flat ``state_dict`` file (:func:`pp_core.checkpoint.export_checkpoint`).
"""

from __future__ import annotations

import time
from pathlib import Path

from pp_core.errors import ConfigError

__all__ = ["export_command"]


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


def export_command(source: Path, args) -> int:
    fmt, output = args.format, Path(args.output)
    directory = fmt == "hf" or (fmt != "pt" and output.suffix not in (".pt", ".safetensors"))
    if not directory:
        if args.dtype or args.max_shard_size:
            raise ConfigError("--dtype and --max-shard-size apply to directory exports; add "
                              "--format hf, or give -o a directory with --format safetensors")
        if fmt is not None and output.suffix != f".{fmt}":
            raise ConfigError(f"--format {fmt} writes a .{fmt} file, -o names "
                              f"{str(output)!r}; name it model.{fmt}, or export a directory "
                              f"with --format hf / --format safetensors -o DIR")
        from pp_core.checkpoint import export_checkpoint  # lazy: DCP, seconds

        print(f"wrote {export_checkpoint(source, output, verify=args.verify)} from {source}")
        return 0
    from pp_core.checkpoint.checksums import verify_checkpoint  # lazy: with a directory
    from pp_core.app.export.hf import export_directory  # lazy: DCP, transformers

    verify_checkpoint(source, args.verify)
    started = time.perf_counter()
    export_directory(source, output, fmt or "safetensors", _dtype(args.dtype),
                     _size(args.max_shard_size))
    files = sorted(p.name for p in output.iterdir() if not p.name.startswith("."))
    print(f"wrote {output} from {source} in {time.perf_counter() - started:.1f} s: "
          f"{', '.join(files)}")
    return 0
