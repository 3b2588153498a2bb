"""A third-party plugin package gives pp-core the tensor-parallel plan of its own model through
the entry-point group ``pp_core`` (issue 22): built and pip-installed here from a temporary
directory (into a ``--target`` folder on ``PYTHONPATH``, so the shared environment is left as it
was), ``pp-core validate`` at ``tp_size: 2`` reports the plan the package's
``pp_tensor_parallel_plan`` returned, and refuses the package's other model, which it has no plan
for."""

import subprocess
import sys

import pytest
import yaml

PLUGIN = '''
"""A model and its tensor-parallel plan, from outside pp-core."""
import pp_core


@pp_core.hookimpl
def pp_register_models(register):
    from pp_tinytp.model import TinyLM, TinyLMNoPlan

    register("tinytp_lm", TinyLM)
    register("tinytp_noplan", TinyLMNoPlan)


@pp_core.hookimpl
def pp_tensor_parallel_plan(model, sequence_parallel):
    if type(model).__name__ != "TinyLM":
        return None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}
'''

MODEL = '''
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab_size=32, dim=16, num_layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(num_layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens):
        x = self.embed(tokens) if self.embed is not None else tokens
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


class TinyLMNoPlan(TinyLM):
    pass
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The package built and pip-installed (no network: setuptools from this environment)."""
    from tests.cases.plugin_packages import install_package

    return install_package(tmp_path_factory.mktemp("tinytp"), "pp_tinytp",
                           {"__init__": PLUGIN, "model": MODEL})


def validate(site, tmp_path, model: str):
    import os

    spec = {"model": {"name": model, "args": {"vocab_size": 32, "dim": 16, "num_layers": 4}},
            "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 32}},
            "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": 4, "pp_microbatch_size": 1,
                         "loss_fn": "cross_entropy"},
            "distributed": {"pp_size": 2, "tp_size": 2}}
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "pp_core", "validate", str(path)], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.cli
def test_validate_reports_the_plan_of_a_third_party_plugin(site, tmp_path):
    result = validate(site, tmp_path, "tinytp_lm")
    assert result.returncode == 0, result.stdout + result.stderr
    # 4 blocks x (up, down) from the package's plan: nothing else in pp-core knows TinyLM
    assert "note: distributed.tp_size: 8 modules sharded 2 ways" in result.stdout, result.stdout


@pytest.mark.cli
def test_validate_refuses_a_model_no_plugin_has_a_plan_for(site, tmp_path):
    result = validate(site, tmp_path, "tinytp_noplan")
    assert result.returncode != 0, result.stdout
    assert "tp_size" in result.stdout + result.stderr, result.stdout + result.stderr
    assert "TinyLMNoPlan" in result.stdout + result.stderr, result.stdout + result.stderr
