"""What the hand-back tests share: a ``pp-core run`` whose losses come back, the tensor names of
an exported ``model.safetensors`` and the logits ``from_pretrained`` gives of a directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tests.cases.specs import pp_core, write_spec

ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # cpu ranks on a GPU machine too


def run_losses(tmp: Path, values: dict) -> list[float]:
    """``pp-core run`` of ``values`` (written to ``tmp/pipe.yaml``); the logged losses."""
    spec = write_spec(tmp / "pipe.yaml", values)
    done = pp_core("run", str(spec), env=ENV, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in Path(values["output"]["metrics"]).read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def run_losses_here(tmp: Path, values: dict) -> list[float]:
    """:func:`run_losses` through ``pp_core.app.cli.main`` in this process: the same command,
    its ranks forked from this process's fork server (started once for the session), without a
    second interpreter importing torch and the model's library for the launcher and another for
    its fork server. A module keeps one :func:`run_losses` that is the command end to end."""
    from pp_core.app import cli

    spec = write_spec(tmp / "pipe.yaml", values)
    assert cli.main(["run", str(spec)]) == 0
    rows = [json.loads(line) for line in Path(values["output"]["metrics"]).read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def safetensors_keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        return set(handle.keys())


def pretrained_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), attn_implementation="eager", local_files_only=True)
    return model(ids).logits
