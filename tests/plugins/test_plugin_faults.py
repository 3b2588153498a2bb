"""A plugin wrong in any way is reported naming it and its distribution, ``pp-core plugins``
lists it as broken, and the commands and the other plugins still work (issue #25, class 5).
Real distributions written in the test, found through importlib.metadata; real commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pp_core.app.check import preflight
from pp_core.app.spec import SpecError, parse_spec
from pp_core.plugin_manager import load_plugins

from tests.cases.cli import PP_CORE

MISNAMED = """
    import pp_core
    @pp_core.hookimpl
    def pp_register_schedules(reg):  # the spec's argument is `register`
        reg("never", None)
"""
RAISING = """
    import pp_core
    @pp_core.hookimpl
    def pp_register_splitters(register):
        raise RuntimeError("boom at registration")
"""
SPLITTERS = """
    import pp_core

    class AcceptsRaises:
        priority = 10_000
        def accepts(self, model):
            raise ValueError("accepts exploded")
        def split(self, model, num_stages, config):
            return []

    class NoSplit:
        def accepts(self, model):
            return True

    class SplitRaises:
        def accepts(self, model):
            return True
        def split(self, model, num_stages, config):
            raise KeyError("split exploded")

    @pp_core.hookimpl
    def pp_register_splitters(register):
        register("acc_raises", AcceptsRaises())
        register("no_split", NoSplit())
        register("split_raises", SplitRaises())
"""
FACTORIES = """
    import os
    import pp_core
    import torch
    from torch import nn

    class InitBoom(nn.Sequential):  # this plugin's pp_runtime_initializers raises for it
        pass

    def model_boom(**args):
        raise RuntimeError("model exploded")

    def model_late(**args):  # builds on the meta device (validate), raises on the ranks
        if torch.empty(0).device.type != "meta":
            raise RuntimeError("model exploded on a rank")
        from pp_core_builtins.models.gpt import GPT
        return GPT(**args)

    def init_boom(**args):
        return InitBoom(nn.Linear(16, 16), nn.Linear(16, 16))

    def data_boom(**args):
        raise RuntimeError("dataset exploded")

    def data_late(**args):  # builds in the launching process (validate), raises on the ranks
        if "RANK" in os.environ:
            raise RuntimeError("dataset exploded on a rank")
        from pp_core_builtins.models.datasets import synthetic
        return synthetic(**args)

    @pp_core.hookimpl
    def pp_register_models(register):
        for factory in (model_boom, model_late, init_boom):
            register(factory.__name__, factory)

    @pp_core.hookimpl
    def pp_register_datasets(register):
        register("data_boom", data_boom)
        register("data_late", data_late)

    @pp_core.hookimpl
    def pp_runtime_initializers(module):
        if isinstance(module, InitBoom):
            raise RuntimeError("initializers exploded")
        return None
"""
DISTS = {"pp-misnamed": ("ppt_misnamed", MISNAMED), "pp-raising": ("ppt_raising", RAISING),
         "pp-splitters": ("ppt_splitters", SPLITTERS), "pp-factories": ("ppt_factories", FACTORIES)}


def _write_dists(root):
    for dist, (module, source) in DISTS.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
        (info / "entry_points.txt").write_text(f"[pp_core]\n{module} = {module}\n")


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    root = tmp_path_factory.mktemp("dists")
    _write_dists(root)
    return root


@pytest.fixture
def installed(dists, monkeypatch):
    monkeypatch.syspath_prepend(str(dists))
    yield load_plugins()
    for name in [m for m in sys.modules if m.startswith("ppt_")]:
        del sys.modules[name]


def _run(dists, *argv, cwd=None):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",  # cpu ranks on a GPU machine too
           "PYTHONPATH": str(dists) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([PP_CORE, *argv], capture_output=True, text=True, env=env, timeout=120,
                          cwd=cwd)


@pytest.mark.cli
def test_plugins_lists_the_broken_ones_and_the_commands_still_work(dists):
    listed = _run(dists, "plugins")
    assert listed.returncode == 0, listed.stderr
    out = listed.stdout
    for name, dist, what in (("ppt_misnamed", "pp-misnamed", "failed validation"),
                             ("ppt_raising", "pp-raising", "raised in pp_register_splitters")):
        assert f"{name}  [{dist} 1.2.3]" in out and f"plugin {name!r} ({dist} 1.2.3) {what}" \
            in out, out
    assert "BROKEN" in out and "acc_raises" in out and "1f1b" in out
    shown = _run(dists, "schedule", "show", "1f1b", "--pp", "2", "--microbatches", "2")
    assert shown.returncode == 0 and "rank1" in shown.stdout, shown.stderr
    assert "Traceback" not in shown.stderr + listed.stderr


GPT = {"model": {"name": "gpt", "args": {"dim": 16, "num_layers": 2, "num_heads": 2,
                                         "max_seq_len": 8, "vocab_size": 64}},
       "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 64}},
       "pipeline": {"pp_batch_size": 2, "loss_fn": "cross_entropy"}}


def test_automatic_choice_passes_over_a_splitter_whose_accepts_raises(installed, caplog):
    found = preflight(parse_spec(GPT), installed, run_checks=False)
    assert found.plan is not None and found.plan.splitter == "layers"
    assert any("splitter 'acc_raises' from plugin 'ppt_splitters' (pp-splitters 1.2.3)" in
               r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("splitter, expected", [
    ("acc_raises", "accepts() raised ValueError: accepts exploded"),
    ("no_split", "has no split(model, num_stages, config) method"),
    ("split_raises", "split() raised KeyError"),
])
def test_a_named_broken_splitter_is_blamed_with_its_plugin(installed, splitter, expected):
    spec = parse_spec({**GPT, "model": {**GPT["model"], "splitter": splitter}})
    with pytest.raises(SpecError) as info:
        preflight(spec, installed, run_checks=False)
    message = str(info.value)
    assert f"splitter {splitter!r} from plugin 'ppt_splitters' (pp-splitters 1.2.3)" in message
    assert expected in message and "PP_CORE_DISABLE_PLUGINS" in message or \
        "docs/splitting.md" in message, message


BLAMED = "from plugin 'ppt_factories' (pp-factories 1.2.3)"


@pytest.mark.cli
@pytest.mark.ranks
@pytest.mark.parametrize("command, model, data, expected", [
    ("validate", "model_boom", "synthetic", "model.args: the model factory refused these "
     "arguments (RuntimeError: model exploded); fix model.args, or model 'model_boom' " + BLAMED),
    ("validate", "gpt", "data_boom", "data.args: dataset 'data_boom' refused these arguments "
     "(RuntimeError: dataset exploded); fix data.args, or dataset 'data_boom' " + BLAMED),
    ("validate", "init_boom", "synthetic", "model: plugin 'ppt_factories' (pp-factories 1.2.3): "
     "pp_runtime_initializers(module=InitBoom) raised RuntimeError: initializers exploded"),
    ("run", "model_late", "synthetic", "failed: PluginError: the model factory refused these "
     "arguments (RuntimeError: model exploded on a rank); fix model.args, or model 'model_late' "
     + BLAMED),
    ("run", "gpt", "data_late", "failed: PluginError: dataset 'data_late' refused these "
     "arguments (RuntimeError: dataset exploded on a rank); fix data.args, or dataset "
     "'data_late' " + BLAMED),
    ("run", "gpt", "synthetic", None),  # the others still work, the broken plugins installed
], ids=["model-validate", "dataset-validate", "initializers-validate", "model-run", "dataset-run",
        "others-work"])
def test_a_plugin_factory_that_raises_is_one_message_naming_it(dists, tmp_path, command, model,
                                                               data, expected):
    """A plugin's model, dataset or pp_runtime_initializers that raises: one line naming the
    YAML key, the name, the plugin and its distribution, at validate and from the ranks."""
    spec = {**GPT, "model": {**GPT["model"], "name": model},
            "data": {**GPT["data"], "name": data}, "train": {"steps": 1}}
    path = tmp_path / "pipe.yaml"
    path.write_text(json.dumps(spec))
    done = _run(dists, command, str(path), cwd=tmp_path)
    if expected is None:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode != 0 and expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
