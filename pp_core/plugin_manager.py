"""The plugin manager: loads the ``pp_core`` entry points and turns hook results into registries.

Nothing here runs at import time. :func:`make_plugin_manager` builds a fresh manager (its loading
is :mod:`pp_core.plugin_loading`; the names stay importable from here);
:class:`Plugins` is the one facade through which the engine calls hooks, so the rest of pp-core
calls typed methods, never ``pm.hook.*``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable

import pluggy

from pp_core.errors import PluginError, PPCoreError
from pp_core.initializer import checked_initializers
from pp_core.plugin_faults import DISABLE_ENV, BrokenPlugin, describe_error, plugin_call
from pp_core.plugin_loading import (CORE_PLUGIN_NAME, ENTRY_POINT_GROUP, PPCorePluginManager,
                                    leave_out, make_plugin_manager)
from pp_core.registry import Registry, RegistryEntry  # noqa: F401 (re-exported)

__all__ = [
    "ENTRY_POINT_GROUP",
    "CORE_PLUGIN_NAME",
    "DISABLE_ENV",
    "BrokenPlugin",
    "Registry",
    "Plugins",
    "PPCorePluginManager",
    "make_plugin_manager",
    "load_plugins",
    "default_plugins",
    "plugins_or_default",
]

logger = logging.getLogger(__name__)


class Plugins:
    """The facade over one plugin manager: every hook call of the engine goes through here."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        # a plain pluggy manager handed in by the caller: no plugin left out, none installed
        self._records = pm if isinstance(pm, PPCorePluginManager) else PPCorePluginManager()
        self._failed_reporters: set[str] = set()  # pp_report_metrics raised: not called again

    @property
    def broken(self) -> list[BrokenPlugin]:
        return list(self._records.broken)

    def distribution(self, plugin_name: str) -> tuple[str, str]:
        return self._records.distributions.get(plugin_name, ("in-process", ""))

    def describe(self, plugin_name: str) -> str:
        """``plugin 'p' (pp-p 1.0)``: a plugin as an error names it."""
        return f"plugin {plugin_name!r} ({' '.join(self.distribution(plugin_name)).strip()})"

    def origin(self, kind: str, name: str) -> str:
        """``model 'gpt' from plugin 'p' (pp-p 1.0)``: who registered ``name`` (``kind``:
        ``schedule``, ``splitter``, ``model`` or ``dataset``); an unknown name raises."""
        entry = getattr(self, f"{kind}s").entry(name)
        return f"{kind} {entry.name!r} from {self.describe(entry.plugin)}"

    def _collect(self, hook_name: str, kind: str, aliases_of: Callable[[Any], Iterable[str]]):
        registry = Registry(kind)
        hook = getattr(self.pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            plugin = impl.plugin_name
            if any(b.name == plugin for b in self.broken):
                continue  # left out already (it raised in another registration hook)
            staged: list[tuple] = []  # kept only when the whole hook succeeds

            def register(name, value, _staged=staged):
                if not isinstance(name, str) or not name:
                    raise PluginError(f"it registered a {kind} with name {name!r}; names must "
                                      f"be non-empty strings")
                _staged.append((name, value))

            try:
                impl.function(register)
            except Exception as exc:  # a plugin defect: report it, keep the others
                dist, version = self.distribution(plugin)
                broken = BrokenPlugin(plugin, dist, version, describe_error(exc), hook_name)
                if plugin not in self._records.distributions:
                    # passed in by the caller, not installed: the caller hears of it at once
                    raise PluginError(broken.message()) from exc
                leave_out(self._records, broken)
                continue
            for name, value in staged:  # a clash between two plugins names both
                registry.add(name, value, plugin, aliases_of(value))
        return registry

    @functools.cached_property
    def schedules(self) -> Registry:
        # a ScheduleDef carries its aliases; a bare generator function has none. The schedule
        # half (pp_core.schedule.build) turns either into a ScheduleDef: the manager sits below
        # it and does not import it.
        return self._collect("pp_register_schedules", "schedule",
                             lambda value: tuple(getattr(value, "aliases", ())))

    @functools.cached_property
    def splitters(self) -> Registry:
        return self._collect("pp_register_splitters", "splitter", lambda v: ())

    @functools.cached_property
    def models(self) -> Registry:
        return self._collect("pp_register_models", "model", lambda v: ())

    @functools.cached_property
    def datasets(self) -> Registry:
        return self._collect("pp_register_datasets", "dataset", lambda v: ())

    def runtime_initializers(self, module) -> list:
        """Every plugin's initializers for ``module``, in hook-call order (``None`` skipped)."""
        found = []
        for impl in reversed(self.pm.hook.pp_runtime_initializers.get_hookimpls()):
            result = plugin_call(self.describe(impl.plugin_name),
                                 f"pp_runtime_initializers(module={type(module).__name__})",
                                 impl.function, module=module)
            if result is not None:
                items = checked_initializers(result, lambda: self.describe(impl.plugin_name),
                                             f"pp_runtime_initializers(module="
                                             f"{type(module).__name__})")
                found.extend((impl.plugin_name, item) for item in items)
        return found

    def run_step(self, pipeline, training: bool, step: Callable[[], Any]) -> Any:
        """Run ``step()`` inside every ``pp_pipeline_step`` wrapper; return what it returned."""
        hook = self.pm.hook.pp_pipeline_step
        impls = hook.get_hookimpls()
        if not impls:
            return step()
        for impl in impls:
            if not (impl.wrapper or impl.hookwrapper):
                raise PluginError(
                    f"plugin {impl.plugin_name!r} implements pp_pipeline_step without "
                    f"wrapper=True; write @hookimpl(wrapper=True) and 'result = yield' around "
                    f"the step, then 'return result'"
                )

        raised: list[str] = []  # the step's exception as text: holding the exception itself
        # would keep its frames (the executor's in-flight work) alive and stall the teardown

        def run(pipeline, training):
            try:
                return step()
            except BaseException as exc:
                raised.append(f"{type(exc).__name__}: {exc}")
                raise

        # call_extra adds the step itself as the innermost implementation, for this call only
        result = hook.call_extra([run], {"pipeline": pipeline, "training": training})
        if raised:  # a wrapper swallowed the step's exception: the pipeline is half-run
            names = ", ".join(impl.plugin_name for impl in impls)
            raise PluginError(f"a pp_pipeline_step wrapper ({names}) swallowed the step's "
                              f"exception {raised[0][:600]}; a wrapper must let it propagate "
                              f"(result = yield re-raises it)")
        return result

    def report_metrics(self, step: int, metrics: dict) -> None:
        """Hand one logged step's figures to every ``pp_report_metrics`` implementation; one
        that raises is logged and skipped from then on (a metrics sink must not end a run)."""
        failed = self._failed_reporters
        for impl in self.pm.hook.pp_report_metrics.get_hookimpls():
            if impl.plugin_name in failed:
                continue
            try:
                impl.function(step=step, metrics=dict(metrics))
            except Exception as exc:
                failed.add(impl.plugin_name)
                logger.error("plugin %r raised in pp_report_metrics at step %d: %s: %s; it gets "
                             "no more metrics this run (fix the plugin or skip it with %s=%s)",
                             impl.plugin_name, step, type(exc).__name__, exc, DISABLE_ENV,
                             impl.plugin_name)

    def tensor_parallel_plan(self, model, sequence_parallel: bool):
        """The first plugin's ``pp_tensor_parallel_plan`` for ``model``, or ``None``; a plugin
        that raises is named (:meth:`first_answer`)."""
        return self.first_answer("pp_tensor_parallel_plan", model=model,
                                 sequence_parallel=sequence_parallel)

    def expert_parallel_plan(self, model):
        """The first plugin's ``pp_expert_parallel_plan`` for ``model``, or ``None``; a plugin
        that raises is named (:meth:`first_answer`)."""
        return self.first_answer("pp_expert_parallel_plan", model=model)

    def first_answer(self, hook_name: str, **kwargs):
        """A ``firstresult`` hook called as pluggy calls it (the last registered plugin first,
        ``tryfirst``/``trylast`` honoured), one implementation at a time, so that one which
        raises is blamed by name (:func:`~pp_core.plugin_faults.plugin_call`); ``None`` when
        every plugin passes. ``model`` in ``kwargs`` is named by its class."""
        return self._first(hook_name, kwargs)[0]

    def first_answerer(self, hook_name: str, **kwargs) -> str:
        """``plugin 'p' (pp-p 1.0)``: the plugin whose answer :meth:`first_answer` returns (or
        that raised); ``"no plugin"`` when every plugin passes."""
        try:
            plugin = self._first(hook_name, kwargs)[1]
        except PPCoreError as exc:
            plugin = getattr(exc, "pp_plugin_name", None)
        return "no plugin" if plugin is None else self.describe(plugin)

    def _first(self, hook_name: str, kwargs: dict):
        shown = ", ".join(f"{k}={type(v).__name__}" if k == "model" else f"{k}={v!r}"
                          for k, v in kwargs.items())
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            if impl.wrapper or impl.hookwrapper:
                continue
            try:
                result = plugin_call(self.describe(impl.plugin_name), f"{hook_name}({shown})",
                                     impl.function, *(kwargs[name] for name in impl.argnames))
            except PPCoreError as exc:
                exc.pp_plugin_name = impl.plugin_name
                raise
            if result is not None:
                return result, impl.plugin_name
        return None, None

    def recv_buffer_allocator(self, config, program, rank, device):
        return self.pm.hook.pp_make_recv_buffer_allocator(
            config=config, program=program, rank=rank, device=device
        )


def load_plugins(entry_points: bool = True, plugins: Iterable[Any] = (), disabled=None) -> Plugins:
    """A fresh :class:`Plugins` facade (see :func:`make_plugin_manager` for the arguments)."""
    return Plugins(make_plugin_manager(entry_points=entry_points, plugins=plugins, disabled=disabled))


@functools.lru_cache(maxsize=1)
def default_plugins() -> Plugins:
    """The installed plugins, loaded once per process on first use (never at import time)."""
    return load_plugins()


def plugins_or_default(plugins=None) -> Plugins:
    """``plugins`` as a :class:`Plugins`: the installed ones when ``None``, a pluggy
    ``PluginManager`` wrapped. Every function that takes ``plugins=None`` resolves it here."""
    if plugins is None:
        return default_plugins()
    if isinstance(plugins, Plugins):
        return plugins
    return Plugins(plugins)
