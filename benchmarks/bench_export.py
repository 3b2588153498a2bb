"""``pp-core export --format hf``: time and peak memory against the model's size.

For each size a Llama (vocab 32000, fp32) is built once, saved as a pp-core DCP checkpoint (one
process), then exported in a fresh process - the streamed ``save_pretrained`` directory
(``--format hf``) and, for comparison, the flat file that gathers every tensor
(``-o model.safetensors``). Each child imports everything and builds the meta model first, then
resets the peak and exports; "peak" is ``VmHWM - VmRSS`` after that reset (the export's own
memory, not torch's and transformers' code). ``--lora`` measures ``--merge`` instead: the
checkpoint of the same model with LoRA adapters (r 16 on every attention and MLP projection) is
exported merged (streamed, ``merge``) beside the flat file of the same checkpoint (whole).

    python benchmarks/bench_export.py [--sizes 512x8 1024x12 2048x8] [--lora] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(size: str) -> dict:
    hidden, layers = map(int, size.split("x"))
    return dict(model_type="llama", vocab_size=32000, hidden_size=hidden,
                intermediate_size=int(hidden * 2.6875) // 16 * 16, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                max_position_embeddings=2048, tie_word_embeddings=False)


LORA = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"]}


def make_checkpoint(size: str, root: Path, lora: bool = False) -> tuple[Path, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pp_core.app.adapters import apply_adapters
    from pp_core.checkpoint import save_checkpoint

    values = _config(size)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config)
    if lora:
        model = apply_adapters(model, dict(LORA, init_lora_weights=False), None)
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    section = {"name": "hf_causal_lm", "target": None, "args": {"config": _config(size)},
               **({"lora": LORA} if lora else {})}
    path = save_checkpoint(root / "ckpt", 1, [model], [None],
                           record={"run": {"model": section},
                                   "export": {"model": section, "data": {}}})
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return path, nbytes


def child(checkpoint: str, output: str, mode: str) -> None:
    from benchmarks._common import proc_status, reset_peak
    from pp_core.checkpoint import export_checkpoint
    from pp_core.app.export.hf import export_hf_directory, hf_target, recorded_export
    from pp_core.app.export.peft import export_merged

    hf_target(recorded_export(checkpoint)["model"])  # transformers imported, meta model built
    reset_peak()
    base = proc_status("VmRSS")
    started = time.perf_counter()
    if mode == "hf":
        export_hf_directory(checkpoint, output)
    elif mode == "merge":
        export_merged(checkpoint, output)
    else:
        export_checkpoint(checkpoint, output)
    print(json.dumps({"seconds": time.perf_counter() - started,
                      "peak_bytes": proc_status("VmHWM") - base}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["512x8", "1024x12", "2048x8"])
    parser.add_argument("--lora", action="store_true", help="measure --merge")
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=3)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    rows = []
    for size in args.sizes:
        root = Path(tempfile.mkdtemp(prefix="bench_export_"))
        try:
            checkpoint, nbytes = make_checkpoint(size, root, args.lora)
            row = {"size": size, "model_bytes": nbytes}
            first = "merge" if args.lora else "hf"
            for mode, out in ((first, root / "hf"), ("flat", root / "model.safetensors")):
                done = subprocess.run([sys.executable, __file__, "--child", str(checkpoint),
                                       str(out), mode], capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(done.stderr[-3000:])
                row[mode] = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            mib = 2**20
            print(f"{size:>8}: model {nbytes / mib:7.0f} MiB | {first} "
                  f"{row[first]['seconds']:5.1f} s, "
                  f"peak {row[first]['peak_bytes'] / mib:6.0f} MiB | flat "
                  f"{row['flat']['seconds']:5.1f} s, peak {row['flat']['peak_bytes'] / mib:6.0f} "
                  f"MiB", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
