"""The seams between pp-core and its plugins, read from the source with ``ast``.

* Every hook is called through the facade (:class:`pp_core.plugin_manager.Plugins`): no module
  of ``pp_core`` or of the built-in plugins but ``plugin_manager.py`` touches ``pm.hook`` -
  so a plugin that raises in any hook is blamed by name, never a raw traceback.
* No built-in plugin imports another plugin's module: each is registered through its own entry
  points exactly as a third party's is, and shares code only through ``pp_core`` (a plugin is
  a subpackage of ``pp_core_builtins``: ``models``, ``transformers``, ``schedules``, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from torch import nn

from pp_core import hookimpl
from pp_core.errors import PluginError
from pp_core.testing import plugins_with

ROOT = Path(__file__).resolve().parents[2]
FACADE = ROOT / "pp_core" / "plugin_manager.py"


def _hook_calls(path: Path) -> list[int]:
    """Lines of ``<anything>.hook.<name>`` or ``.pm.hook`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "hook":
            found.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "hook" and \
                isinstance(node.value, ast.Attribute) and node.value.attr == "pm":
            found.append(node.lineno)
    return sorted(set(found))


def _sources():
    for base in (ROOT / "pp_core", ROOT / "plugins"):
        yield from sorted(base.rglob("*.py"))


def test_every_hook_is_called_through_the_facade():
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in _sources() if path != FACADE
           for line in _hook_calls(path)]
    assert not bad, ("hook calls around the plugin facade (add a Plugins method in "
                     "pp_core/plugin_manager.py and call that):\n" + "\n".join(bad))


def test_the_hook_call_checker_sees_one(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(plugins, m):\n    return plugins.pm.hook.pp_expert_parallel_plan("
                      "model=m)\n\ndef g(pm):\n    pm.hook.pp_tensor_parallel_plan(model=1)\n")
    assert _hook_calls(sample) == [2, 5]


def _plugin_of(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pp_core_builtins" and len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def crossings(base: Path) -> list[str]:
    """``file:line imports <module> of plugin <other>`` for each import, in the plugin packages
    under ``base`` (``base/pp_core_builtins/<plugin>/...``), of another plugin's module."""
    bad = []
    for path in sorted(base.rglob("*.py")):
        module = ".".join(path.relative_to(base).with_suffix("").parts)
        mine = _plugin_of(module)
        for target, line in _imports(path):
            theirs = _plugin_of(target)
            if mine and theirs and theirs != mine:
                bad.append(f"{path.relative_to(base)}:{line} ({mine}) imports {target} "
                           f"({theirs})")
    return bad


def test_no_plugin_imports_another_plugins_module():
    bad = crossings(ROOT / "plugins")
    assert not bad, ("a plugin imports another plugin's module; share the code through the "
                     "library (pp_core) instead:\n" + "\n".join(bad))


def test_the_crossing_checker_sees_one(tmp_path):
    package = tmp_path / "pp_core_builtins"
    (package / "a").mkdir(parents=True)
    (package / "b").mkdir()
    (package / "a" / "x.py").write_text("from pp_core_builtins.a.y import z\n")
    (package / "b" / "__init__.py").write_text("def f():\n"
                                               "    from pp_core_builtins.a.x import g\n")
    assert crossings(tmp_path) == ["pp_core_builtins/b/__init__.py:2 (pp_core_builtins.b) "
                                   "imports pp_core_builtins.a.x.g (pp_core_builtins.a)"]


class _RaisingPlans:
    @hookimpl
    def pp_expert_parallel_plan(self, model):
        raise KeyError("experts")

    @hookimpl
    def pp_tensor_parallel_plan(self, model, sequence_parallel):
        raise KeyError("qkv")


@pytest.mark.parametrize("call, hook", [
    (lambda plugins: plugins.expert_parallel_plan(nn.Linear(2, 2)),
     "pp_expert_parallel_plan(model=Linear) raised KeyError: 'experts'"),
    (lambda plugins: plugins.tensor_parallel_plan(nn.Linear(2, 2), True),
     "pp_tensor_parallel_plan(model=Linear, sequence_parallel=True) raised KeyError: 'qkv'"),
])
def test_a_plan_hook_that_raises_is_blamed_by_name(call, hook):
    with pytest.raises(PluginError) as error:
        call(plugins_with(_RaisingPlans()))
    assert str(error.value) == (
        f"plugin '_RaisingPlans' (in-process): {hook}; this is a defect of the plugin: fix it, "
        f"name another, or skip the plugin with PP_CORE_DISABLE_PLUGINS=<plugin name>")


def test_one_matcher_one_meaning_of_star_for_tp_and_ep():
    from pp_core.parallel.expert import planned_modules
    from pp_core.parallel.plans import matching_modules
    from pp_core.parallel.tensor_parallel import plan_modules

    assert plan_modules is matching_modules and planned_modules is matching_modules
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Module(), "1": nn.Module()})
    model.layers["0"].moe = nn.Linear(2, 2)
    model.layers["1"].block = nn.Module()
    model.layers["1"].block.moe = nn.Linear(2, 2)  # two names below layers.1: * is one name
    found = matching_modules(model, {"layers.*.moe": "first", "layers.0.*": "second"})
    assert [(fqn, style) for fqn, _, style in found] == [("layers.0.moe", "first")]


class _Recorder:
    def __init__(self):
        self.applied = []

    def apply(self, module, ep_group):
        self.applied.append((type(module).__name__, ep_group))


def test_one_rule_for_parts_a_part_without_a_plan_is_left_alone_none_at_all_is_refused():
    from pp_core.errors import ConfigError
    from pp_core.parallel.expert import apply_expert_parallel
    from pp_core.parallel.plans import plans_of_parts

    style = _Recorder()

    class Planned(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = nn.Linear(2, 2)

    class Plans:
        @hookimpl
        def pp_expert_parallel_plan(self, model):
            return {"moe": style} if isinstance(model, Planned) else None

    parts = [Planned(), nn.Sequential(nn.Linear(2, 2))]
    plugins = plugins_with(Plans())
    assert apply_expert_parallel(parts, None, plugins=plugins) == 1
    assert style.applied == [("Linear", None)]
    assert [type(p).__name__ for p, _ in plans_of_parts(parts, None, lambda p: None)] == []
    with pytest.raises(ConfigError) as error:
        apply_expert_parallel(parts[1:], None, plugins=plugins)
    assert str(error.value) == (
        "no expert-parallel plan for Sequential: no plugin's pp_expert_parallel_plan answered "
        "for it; use a model with MoE layers and a plan (e.g. moe_gpt; a plugin's "
        "pp_expert_parallel_plan or the model's expert_parallel_plan(), docs/plugins.md), or "
        "set distributed.ep_size: 1")


def test_the_core_plugin_answers_a_models_own_expert_parallel_plan():
    """Without any other plugin (the demo plugin no longer asks for it)."""

    class Knows(nn.Module):
        def expert_parallel_plan(self):
            return {"moe": "mine"}

    assert plugins_with().expert_parallel_plan(Knows()) == {"moe": "mine"}


def test_the_core_plugin_answers_a_models_own_tensor_parallel_plan():
    class Knows(nn.Module):
        def tensor_parallel_plan(self, sequence_parallel):
            return {"up": "colwise", "norm": "sequence"} if sequence_parallel else {"up": "colwise"}

    assert plugins_with().tensor_parallel_plan(Knows(), True) == {"up": "colwise",
                                                                  "norm": "sequence"}
    assert plugins_with().tensor_parallel_plan(Knows(), False) == {"up": "colwise"}
    assert plugins_with().tensor_parallel_plan(nn.Linear(2, 2), False) is None
