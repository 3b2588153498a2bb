"""One test per hook (a test below fails when a hook has none), and docs that cannot drift."""

import inspect
import re
import sys
from pathlib import Path

import pytest
from torch import nn

from pp_core import ScheduleDef, hookimpl, hookspecs
from pp_core.schedule.build import resolve_schedule_def
from pp_core.runtime import collect_pipeline_runtime_initializers
from pp_core.testing import plugins_with

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [name for name in hookspecs.__all__ if name.startswith("pp_")]


def test_every_hook_is_documented_with_its_exact_signature():
    docs = (ROOT / "docs" / "plugins.md").read_text()
    for name in HOOKS:
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert f"### {name}({params})" in docs, f"docs/plugins.md lacks a heading for {name}({params})"


def test_every_hook_has_a_test():
    names = {n for path in (ROOT / "tests").rglob("test_*.py")
             for n in re.findall(r"def (test_hook_\w+)", path.read_text())}
    for name in HOOKS:
        assert any(n.startswith(f"test_hook_{name}") for n in names), f"no test_hook_{name}*"


def test_every_hook_has_a_docstring_saying_how_results_combine():
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name))
        assert doc and "Calling:" in doc, name


def _examples(heading):
    """The python example under ``### heading`` in docs/plugins.md, executed as a module."""
    docs = (ROOT / "docs" / "plugins.md").read_text()
    section = docs.split(f"### {heading}")[1].split("\n### ")[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {"__name__": f"docs_example_{heading.split('(')[0]}"}
    exec(compile(code, f"docs/plugins.md:{heading}", "exec"), namespace)
    return type(sys)("example"), namespace


def _plugin_from_doc(heading):
    module, namespace = _examples(heading)
    for key, value in namespace.items():
        if key.startswith("pp_"):
            setattr(module, key, value)
    module.__name__ = namespace["__name__"]
    return module


def test_hook_pp_register_schedules():
    plugins = plugins_with(_plugin_from_doc("pp_register_schedules(register)"))
    definition = resolve_schedule_def("GPIPEREVERSED", plugins)[1]
    assert isinstance(definition, ScheduleDef)
    rows = definition.generate(2, 2, 2)
    assert [" ".join(map(str, row)) for row in rows] == ["0F0 0F1 0B1 0B0", "1F0 1F1 1B1 1B0"]


def test_hook_pp_register_splitters():
    plugins = plugins_with(_plugin_from_doc("pp_register_splitters(register)"))
    splitter = plugins.splitters.get("blocks")
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))
    assert splitter.accepts(model)
    assert splitter.split(model, 2, None) == [["blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "blocks.4"]]


def test_hook_pp_register_models():
    plugins = plugins_with(_plugin_from_doc("pp_register_models(register)"))
    model = plugins.models.get("tiny_mlp")(dim=4, depth=3)
    assert len(model) == 3


def test_hook_pp_register_datasets():
    plugins = plugins_with(_plugin_from_doc("pp_register_datasets(register)"))
    batches = list(plugins.datasets.get("noise")(batch_size=3, dim=2, steps=2))
    assert len(batches) == 2 and batches[0][0].shape == (3, 2)


def test_hook_pp_runtime_initializers():
    plugins = plugins_with(_plugin_from_doc("pp_runtime_initializers(module)"))
    part = nn.Sequential(nn.MultiheadAttention(8, 2), nn.MultiheadAttention(8, 2))
    found = collect_pipeline_runtime_initializers([part], plugins)
    assert [i.resource_key for i in found] == [("attention-workspace",)]


def test_hook_pp_tensor_parallel_plan():
    """The docs' plugin answers for its own model and passes (None) for others; the built-in
    plan answers for the demo GPT; a model nobody knows is refused, saying how to provide one;
    and validation names the module whose size tp_size does not divide."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from pp_core.errors import ConfigError
    from pp_core.parallel.tensor_parallel import check_tensor_parallel, tensor_parallel_plan
    from pp_core_builtins.models.gpt import GPT

    module, namespace = _examples("pp_tensor_parallel_plan(model, sequence_parallel)")
    module.pp_tensor_parallel_plan = namespace["pp_tensor_parallel_plan"]
    module.__name__ = namespace["__name__"]
    plugins = plugins_with(module)
    plan = tensor_parallel_plan(namespace["TinyMLP"](), False, plugins)
    assert set(plan) == {"up", "down"} and isinstance(plan["up"], ColwiseParallel)
    gpt = GPT(vocab_size=32, dim=16, num_layers=2, num_heads=2, max_seq_len=16)
    assert plugins.tensor_parallel_plan(gpt, True) is None  # the docs' plugin passes
    gpt_plan = tensor_parallel_plan(gpt, True)  # the installed built-in answers for its model
    assert "layers.*.qkv" in gpt_plan and "norm" in gpt_plan
    assert "norm" not in tensor_parallel_plan(gpt, False)
    assert check_tensor_parallel(gpt, gpt_plan, 2) == []
    problems = check_tensor_parallel(gpt, gpt_plan, 3)
    assert any("layers.0.proj.in_features = 16" in p for p in problems), problems
    assert any("num_heads = 2" in p for p in problems), problems
    with pytest.raises(ConfigError, match="pp_tensor_parallel_plan"):
        tensor_parallel_plan(nn.Linear(2, 2), False, plugins)


def test_hook_pp_make_recv_buffer_allocator_first_result_wins():
    sentinel = object()

    class Passes:
        @hookimpl
        def pp_make_recv_buffer_allocator(self, config, program, rank, device):
            return None

    class Answers:
        @hookimpl
        def pp_make_recv_buffer_allocator(self, config, program, rank, device):
            return sentinel

    plugins = plugins_with(("answers", Answers()), ("passes", Passes()))
    assert plugins.recv_buffer_allocator(config=None, program=None, rank=0, device="cpu") is sentinel
    doc_plugin = _plugin_from_doc("pp_make_recv_buffer_allocator(config, program, rank, device)")
    assert plugins_with(doc_plugin).recv_buffer_allocator(None, None, 0, "cpu") is None


def test_hook_pp_pipeline_step_wraps_the_step_and_sees_its_result():
    plugin = _plugin_from_doc("pp_pipeline_step(pipeline, training)")
    plugins = plugins_with(plugin)

    class FakePipeline:  # run_step only hands it to the wrappers
        rank = 3

    assert plugins.run_step(FakePipeline(), True, lambda: 1.5) == 1.5
    [(rank, training, seconds)] = plugin.pp_pipeline_step.__globals__["STEP_TIMES"]
    assert (rank, training) == (3, True) and seconds >= 0


def test_hook_pp_report_metrics_gets_each_step_and_a_raising_plugin_is_logged_once(
        tmp_path, monkeypatch, caplog):
    """In process, through the facade (a real ``pp-core run`` with entry-point plugins:
    tests/app/test_run.py)."""
    import json

    class Failing:
        @hookimpl
        def pp_report_metrics(self, step, metrics):
            raise ConnectionError("dashboard unreachable")

    monkeypatch.chdir(tmp_path)
    plugins = plugins_with(_plugin_from_doc("pp_report_metrics(step, metrics)"), Failing())
    with caplog.at_level("ERROR", logger="pp_core.plugin_manager"):
        plugins.report_metrics(1, {"loss": 2.5, "lr": 0.1})
        plugins.report_metrics(2, {"loss": 2.0, "lr": 0.1})
    seen = [json.loads(line) for line in open("metrics_seen.jsonl", encoding="utf-8")]
    assert seen == [{"step": 1, "loss": 2.5, "lr": 0.1}, {"step": 2, "loss": 2.0, "lr": 0.1}]
    [record] = caplog.records
    assert "plugin 'Failing' raised in pp_report_metrics at step 1: ConnectionError: " \
           "dashboard unreachable" in record.getMessage()


def test_hook_pp_pipeline_step_refuses_a_plain_implementation():
    from pp_core import PluginError

    class Plain:
        @hookimpl
        def pp_pipeline_step(self, pipeline, training):
            return "not the step"

    with pytest.raises(PluginError, match=r"plugin 'Plain' implements pp_pipeline_step without "
                                          r"wrapper=True"):
        plugins_with(Plain()).run_step(None, True, lambda: None)


def test_hook_pp_expert_parallel_plan():
    """The doc's plugin answers for its model only; the built-in one for moe_gpt."""
    from pp_core.parallel.expert import planned_modules
    from pp_core_builtins.models.moe_gpt import MoEGPT, ShardExperts

    plugin = _plugin_from_doc("pp_expert_parallel_plan(model)")
    plugins = plugins_with(plugin)
    assert plugins.expert_parallel_plan(nn.Linear(2, 2)) is None
    MyMoEModel = type("MyMoEModel", (nn.Module,), {})
    plan = plugins.expert_parallel_plan(MyMoEModel())
    assert list(plan) == ["layers.*.moe"]
    model = MoEGPT(vocab_size=16, dim=8, num_layers=2, num_heads=2, max_seq_len=4,
                   num_experts=4, top_k=1)
    from pp_core.plugin_manager import plugins_or_default

    plan = plugins_or_default(None).expert_parallel_plan(model)
    found = planned_modules(model, plan)
    assert [fqn for fqn, _, _ in found] == ["layers.0.moe", "layers.1.moe"]
    assert all(isinstance(style, ShardExperts) for _, _, style in found)
