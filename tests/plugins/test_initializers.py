"""collect_pipeline_runtime_initializers: order, dedupe, conflicts, unhashable keys, plugins."""

import re
from dataclasses import dataclass

import pytest
from torch import nn

from pp_core import hookimpl
from pp_core.runtime import PipelineRuntimeInitializer, collect_pipeline_runtime_initializers
from pp_core.testing import plugins_with


@dataclass
class Init:
    resource_key: object
    signature: object
    prepared: int = 0

    def prepare(self, num_tokens, device):
        self.prepared += 1


class Block(nn.Module):
    def __init__(self, *initializers):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self._initializers = list(initializers)

    def pipeline_runtime_initializers(self):
        return self._initializers


def parts(*blocks_per_part):
    return [nn.Sequential(*blocks) for blocks in blocks_per_part]


@pytest.fixture
def plugins():
    return plugins_with()


def test_protocol_is_runtime_checkable():
    assert isinstance(Init("k", 1), PipelineRuntimeInitializer)
    assert not isinstance(object(), PipelineRuntimeInitializer)


def test_same_key_and_signature_kept_once_across_parts_first_wins(plugins):
    first, again, other = Init("rope", (64, "f32")), Init("rope", (64, "f32")), Init("ws", 1)
    found = collect_pipeline_runtime_initializers(
        parts([Block(first), Block(again)], [Block(Init("rope", (64, "f32")), other)]), plugins)
    assert found == [first, other]
    assert found[0] is first
    assert first.prepared == 0 and other.prepared == 0  # nothing prepared at collection time


def test_traversal_order_is_parts_then_named_modules(plugins):
    a, b, c = Init("a", 0), Init("b", 0), Init("c", 0)
    outer = Block(a)
    outer.inner = Block(b)
    found = collect_pipeline_runtime_initializers([nn.Sequential(Block(c)), outer], plugins)
    assert [i.resource_key for i in found] == ["c", "a", "b"]


def test_conflicting_signatures_name_key_both_signatures_and_both_modules(plugins):
    model_parts = parts([Block(Init("rope", (64,)))], [Block(), Block(Init("rope", (128,)))])
    with pytest.raises(RuntimeError) as info:
        collect_pipeline_runtime_initializers(model_parts, plugins)
    message = str(info.value)
    assert "'rope'" in message and "(64,)" in message and "(128,)" in message
    assert "'0' of model part 0 (Block)" in message
    assert "'1' of model part 1 (Block)" in message


@pytest.mark.parametrize("key, signature, what", [(["k"], 1, "resource_key"),
                                                  ("k", {"a": 1}, "signature")])
def test_unhashable_key_or_signature_is_a_type_error_naming_module_and_provider(plugins, key, signature, what):
    with pytest.raises(TypeError, match=rf"runtime initializer Init from plugin "
                                        rf"'pp_core.model_initializers' for module '0' of model "
                                        rf"part 0 \(Block\) has an unhashable {what}"):
        collect_pipeline_runtime_initializers(parts([Block(Init(key, signature))]), plugins)


def test_plugin_hook_supplies_initializers_for_modules_it_knows():
    class Provider:
        @hookimpl
        def pp_runtime_initializers(self, module):
            if isinstance(module, nn.Linear):
                return [Init(("linear-ws", module.in_features), "v1")]
            return None

    plugins = plugins_with(("provider", Provider()))
    found = collect_pipeline_runtime_initializers(parts([Block(), Block()], [Block()]), plugins)
    assert [i.resource_key for i in found] == [("linear-ws", 2)]


class RaisingBlock(Block):
    def pipeline_runtime_initializers(self):
        raise ValueError("bad block")


@pytest.mark.parametrize("where, expected", [
    ("plugin", r"plugin 'broken' \(in-process\): pp_runtime_initializers\(module=Block\) raised "
               r"ValueError: bad module"),
    ("model", rf"class 'RaisingBlock' of module '{re.escape(__name__)}': "
              r"pipeline_runtime_initializers\(\) raised ValueError: bad block"),
])
def test_plugin_raising_is_named(where, expected):
    """Through the plugin guard: a hook that raises is blamed on its plugin, a model's own
    ``pipeline_runtime_initializers()`` on the model's class (not on pp-core's core plugin)."""
    class Broken:
        @hookimpl
        def pp_runtime_initializers(self, module):
            if isinstance(module, Block):
                raise ValueError("bad module")

    from pp_core import PluginError
    plugins = plugins_with(("broken", Broken())) if where == "plugin" else plugins_with()
    with pytest.raises(PluginError, match=expected):
        collect_pipeline_runtime_initializers(
            parts([Block() if where == "plugin" else RaisingBlock()]), plugins)


def test_a_tensor_signature_is_a_type_error_naming_the_provider(plugins):
    """A tensor is hashable, but ``==`` answers with a tensor: it cannot serve as a signature
    (issue #48, item 5); never torch's "Boolean value of Tensor" error."""
    import torch

    model_parts = parts([Block(Init("ws", torch.tensor([1, 2])))],
                        [Block(Init("ws", torch.tensor([1, 2])))])
    with pytest.raises(TypeError) as info:
        collect_pipeline_runtime_initializers(model_parts, plugins)
    assert str(info.value) == (
        "runtime initializer Init from plugin 'pp_core.model_initializers' for module '0' of "
        "model part 0 (Block) has a signature tensor([1, 2]) that cannot be compared (== "
        "answered Tensor, not True or False); make signature a tuple, string, number or frozen "
        "dataclass (e.g. tuple(t.tolist()) for a tensor)")


def test_a_tensor_key_is_a_type_error_naming_the_provider(plugins):
    import torch

    with pytest.raises(TypeError, match=r"^runtime initializer Init from plugin "
                                        r"'pp_core.model_initializers' for module '0' of model "
                                        r"part 0 \(Block\) has a resource_key tensor\(\[3\]\) "
                                        r"that cannot be compared \(== answered Tensor"):
        collect_pipeline_runtime_initializers(parts([Block(Init(torch.tensor([3]), 1))]),
                                              plugins)


def test_signatures_that_cannot_be_compared_name_both_providers(plugins):
    """Each compares with itself (a tuple holding a tensor is equal to itself by identity), but
    not with the other: a conflict the contract reports as a RuntimeError naming both."""
    import torch

    model_parts = parts([Block(Init("ws", (torch.tensor([1, 2]),)))],
                        [Block(Init("ws", (torch.tensor([1, 2]),)))])
    with pytest.raises(RuntimeError) as info:
        collect_pipeline_runtime_initializers(model_parts, plugins)
    assert str(info.value) == (
        "runtime resource 'ws' is requested with signatures that cannot be compared: "
        "(tensor([1, 2]),) by module '0' of model part 0 (Block) and (tensor([1, 2]),) by "
        "module '0' of model part 1 (Block) (== raised RuntimeError); every module sharing a "
        "resource_key must expect the same configuration: make the signatures plain values "
        "(tuples, strings, numbers) that compare equal")
