"""The tiny pipeline files the YAML tests write, and ``pp-core`` run the way a user runs it.

:func:`tiny_gpt_spec` is the demo GPT at its smallest on 2 ranks, as a spec dict; a test names
only what its claim is about (``tiny_gpt_spec(train={"steps": 1})``) and leaves the rest as it
is here. ``TINY`` is the spec ``pp-core run`` tests start from (plain progress lines, 3 steps).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
_TINY_GPT = {
    "model": {"name": "gpt", "args": {"vocab_size": 32, "dim": 16, "num_layers": 4,
                                      "num_heads": 2, "max_seq_len": 8}},
    "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 32}},
    "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": 4, "pp_microbatch_size": 1,
                 "loss_fn": "cross_entropy"},
    "distributed": {"pp_size": 2},
    "train": {"steps": 2},
    "output": {"progress": "off", "summary": False},
}


def tiny_gpt_spec(**sections) -> dict:
    """A fresh spec dict: the tiny GPT above with ``sections`` merged in, key by key at every
    depth (``model={"args": {"num_layers": 2}}`` changes one argument); a ``None`` value removes
    the key (``output=None``: no output section)."""
    return _merged(_TINY_GPT, sections)


def _merged(base: dict, changes: dict) -> dict:
    merged = {key: (_merged(value, {}) if isinstance(value, dict) else value)
              for key, value in base.items()}
    for key, value in changes.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = _merged(value, {}) if isinstance(value, dict) else value
    return merged


TINY = tiny_gpt_spec(distributed={"dp_size": 1, "device": "cpu"},  # the same on a GPU machine
                     train={"steps": 3, "log_every": 1}, output={"progress": "plain",
                                                                 "summary": None})


def pp_core(*args, env=None, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pp_core", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A loopback port nobody listens on right now (the OS picks it): a run's master_port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_spec(path: Path, values: dict, **sections) -> Path:
    values = {**values, **sections}
    path.write_text(yaml.safe_dump(values))
    return path
