"""The core's own plugin: a model that knows itself says so itself.

Registered in every plugin manager (:data:`pp_core.plugin_manager.CORE_PLUGIN_NAME`), so a
model needs no plugin of its own for what it can answer: its runtime initializers (pp-core's
``pipeline_runtime_initializers()`` and NeMo AutoModel's ``get_pipeline_runtime_initializers()``
are both asked; :mod:`pp_core.runtime.initializers` collects the answers) and its parallel plans
(``tensor_parallel_plan(sequence_parallel)``, ``expert_parallel_plan()``; asked after every
other plugin: a plugin may still answer for a model it knows better).
"""

from __future__ import annotations

import inspect

from pp_core import hookspecs
from pp_core.errors import PluginError
from pp_core.initializer import checked_initializers
from pp_core.plugin_faults import code_origin, plugin_call

__all__ = ["ModelInitializers"]


class ModelInitializers:
    """The core's own plugin, in every manager: a module that owns process-local resources
    lists them itself, in a ``pipeline_runtime_initializers()`` method, or - a NeMo AutoModel
    model - in ``get_pipeline_runtime_initializers()`` (see :mod:`pp_core.runtime.initializers`).
    pp-core's name is asked first; a module defining both must give the same answer."""

    @hookspecs.hookimpl
    def pp_runtime_initializers(self, module):
        found = [name for name in ("pipeline_runtime_initializers",
                                   "get_pipeline_runtime_initializers")
                 if _defines(module, name)]
        if not found:
            return None
        answers = [self._ask(module, name) for name in found]
        if len(answers) == 2 and _identity(answers[0]) != _identity(answers[1]):
            raise PluginError(
                f"{type(module).__qualname__} defines both pipeline_runtime_initializers() "
                f"(pp-core) and get_pipeline_runtime_initializers() (NeMo AutoModel) and they "
                f"answer differently ({_listed(answers[0])} vs {_listed(answers[1])}); define "
                f"one of the two, or make the second return the first's list")
        return answers[0] or None

    @staticmethod
    def _ask(module, name: str) -> list:
        """``module.<name>()`` as a list; what it raises or returns wrong (a dict, an int, items
        without ``resource_key``; a generator that raises) is blamed on the module's class."""
        def origin():
            return code_origin(module)

        def ask():
            answer = getattr(module, name)()
            return [] if answer is None else checked_initializers(answer, origin, f"{name}()")
        return plugin_call(origin, f"{name}()", ask)

    @hookspecs.hookimpl(trylast=True)
    def pp_tensor_parallel_plan(self, model, sequence_parallel):
        if not _defines(model, "tensor_parallel_plan"):
            return None
        return plugin_call(lambda: code_origin(model), "tensor_parallel_plan(sequence_parallel)",
                           model.tensor_parallel_plan, sequence_parallel)

    @hookspecs.hookimpl(trylast=True)
    def pp_expert_parallel_plan(self, model):
        if not _defines(model, "expert_parallel_plan"):
            return None
        return plugin_call(lambda: code_origin(model), "expert_parallel_plan()",
                           model.expert_parallel_plan)


def _defines(module, name: str) -> bool:
    """Whether ``module`` (its class, or the instance itself) defines a callable ``name``; read
    statically, as NeMo does, so a submodule of that name or a ``__getattr__`` never counts."""
    try:
        inspect.getattr_static(module, name)
    except AttributeError:
        return False
    return callable(getattr(module, name, None))


def _identity(initializers):
    """What two answers must share: each initializer's type, resource_key and signature (two
    calls may well build new but equal objects)."""
    return [(type(i), repr(getattr(i, "resource_key", None)), repr(getattr(i, "signature", None)))
            for i in initializers]


def _listed(initializers) -> str:
    return "[" + ", ".join(type(i).__name__ for i in initializers) + "]"
