"""The proof that "pip install a plugin" works: install examples/pp_example_plugin for real."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cases.cli import PP_CORE

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "examples" / "pp_example_plugin"


@pytest.fixture(scope="module")
def installed():
    """pip-install the example package into this environment (as a user would), once."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", str(PACKAGE)],
        check=True, capture_output=True, text=True,
    )
    yield


def run(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True, cwd=ROOT).stdout


@pytest.mark.cli
def test_pp_core_plugins_lists_the_installed_package(installed):
    rows = {row["name"]: row for row in json.loads(run(PP_CORE, "plugins", "--json"))}
    example = rows["example"]
    assert (example["distribution"], example["version"]) == ("pp-example-plugin", "0.1.0")
    assert example["provides"] == {"models": ["example_mlp"], "datasets": ["example_regression"]}
    text = run(sys.executable, "-m", "pp_core", "plugins")
    assert "example  [pp-example-plugin 0.1.0]" in text and "models: example_mlp" in text


COLLECT = """
import torch
from torch import nn
from pp_core.plugin_manager import default_plugins
from pp_core.runtime import collect_pipeline_runtime_initializers

model = default_plugins().models.get("example_mlp")(num_layers=4)
# one rank holding two stages of the model: blocks 0-1 and blocks 2-3
parts = [nn.ModuleList(model.layers[:2]), nn.ModuleList(model.layers[2:])]
found = collect_pipeline_runtime_initializers(parts)
assert len(found) == 1, found
found[0].prepare(6, torch.device("cpu"))
x = torch.randn(2, 6, 8)
print(tuple(model(x).shape), type(found[0]).__module__)
"""


@pytest.mark.cli
def test_collector_finds_the_shared_initializer_once_for_several_blocks(installed):
    out = run(sys.executable, "-c", COLLECT)
    assert out.split() == ["(2,", "6,", "4)", "pp_example_plugin.model"]


@pytest.mark.cli
def test_validate_prepares_the_models_runtime_initializers_before_its_meta_microbatch(installed):
    """The example's blocks read a position table that only prepare() makes: validate runs one
    microbatch on the meta device, so it must prepare it first, as the executor does."""
    out = subprocess.run([PP_CORE, "validate", str(ROOT / "examples" / "plugin_model.yaml")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout and "not run on the meta device" not in out.stdout, out.stdout
