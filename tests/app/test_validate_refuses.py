"""``validate`` refuses what would fail as soon as the ranks start (issue #25, class 8), one
line naming the key; table-driven over real pipeline files and real loss/model modules."""

from __future__ import annotations

import pytest
import yaml

from pp_core.app import cli
from tests.cases.specs import tiny_gpt_spec

ARGS = {"dim": 16, "num_layers": 2, "num_heads": 2, "max_seq_len": 8, "vocab_size": 64}
BASE = tiny_gpt_spec(model={"args": ARGS}, data={"args": {"vocab_size": 64}},
                     pipeline={"pp_schedule": None, "pp_batch_size": 2, "pp_microbatch_size": None},
                     train=None, output=None)
LOSSES = """
import torch
import torch.nn.functional as F

def per_token(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="none")

def an_int(output, target):
    return 3

def detached(output, target):
    return torch.zeros((), device=output.device)

class DictModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)])

    def forward(self, x):
        return {"logits": self.layers[1](self.layers[0](x))}
"""


def _with(section: str, **values) -> dict:
    return {**BASE, section: {**BASE.get(section, {}), **values}}


FQNS = [["tok_embeddings", "pos_embeddings", "layers.1"], ["layers.0", "norm", "output"]]
CASES = [
    (_with("train", compile={"backend": "no_such_backend"}), "unknown backend 'no_such_backend'"),
    (_with("train", compile={"mode": "fast"}), "mode: expected one of default"),
    (_with("train", compile={"mode": "max-autotune", "options": {"trace.enabled": True}}),
     "mode and options"),
    (_with("train", compile={"fullgraph": "yes"}), "fullgraph: expected true or false"),
    (_with("pipeline", dtype="float8_e4m3fn"), "pipeline.dtype"),
    (_with("pipeline", loss_fn="losses_mod:per_token"), "expected one number"),
    (_with("pipeline", loss_fn="losses_mod:an_int"), "the loss returned int 3"),
    (_with("pipeline", loss_fn="losses_mod:detached"), "a tensor without gradient"),
    (_with("pipeline", loss_fn=":"), "pipeline.loss_fn: loss_fn=':': expected 'module:attr'"),
    ({**_with("data", eval_args={"seq_len": 32}), "train": {"eval_every": 1}},
     "data.eval_args: the data's sequence length 32 is more than the model's max_seq_len 8"),
    (_with("data", args={"seq_len": 8, "vocab_size": 256}), "data.args: the data holds input "
                                                             "token id"),
    (_with("pipeline", module_fqns_per_model_part=FQNS), "stages must follow the model's order"),
    (_with("distributed", timeout_s=10**12), "distributed.timeout_s: expected an int in [1, "),
    (_with("distributed", dp_shard=2, mixed_precision={"param_dtype": "float64"}),
     "distributed.mixed_precision"),
    (_with("train", grad_clip=0), "train.grad_clip: expected a finite number > 0"),
    (_with("model", args={**ARGS, "dim": 32768, "num_heads": 8, "num_layers": 48}),
     "is more than this machine's"),
    ({**_with("pipeline", pp_schedule="auto"), "model": {**BASE["model"],
                                                          "splitter": "sequential"}},
     "model.splitter: splitter 'sequential'"),
    ({**BASE, "model": {"target": "losses_mod:DictModel"}}, "the model returned dict"),
    (_with("model", args={**ARGS, "num_heads": 5}), "fix model.args, or model 'gpt' from "
                                                     "plugin 'pp_core_builtins.models' (pp-core"),
    (_with("distributed", nnodes=2, node_rank=2, master_port=29999, rdzv_backend="static"),
     "distributed.node_rank: expected this machine's index 0..1 (nnodes=2), found 2"),
]


@pytest.mark.parametrize("values, expected", CASES, ids=[c[1][:40] for c in CASES])
def test_validate_refuses(tmp_path, capsys, monkeypatch, values, expected):
    (tmp_path / "losses_mod.py").write_text(LOSSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(values))
    code = cli.main(["validate", str(tmp_path / "pipe.yaml")])
    out = capsys.readouterr()
    assert code == 1, out.out
    assert expected in out.err and "Traceback" not in out.err, out.err


def test_the_base_file_is_fine(tmp_path, capsys):
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(BASE))
    assert cli.main(["validate", str(tmp_path / "pipe.yaml")]) == 0, capsys.readouterr().err
