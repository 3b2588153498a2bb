"""The plugin manager: entry-point loading, broken plugins, misspelled hooks, clashes, blocking."""

import sys

import pytest

from pp_core import PluginError, ScheduleDef, hookimpl
from pp_core.schedule.build import resolve_schedule_def
from pp_core.plugin_manager import Plugins, load_plugins, make_plugin_manager
from pp_core.testing import plugins_with
from tests.cases.plugin_packages import make_dist


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("ppt_")]:
        del sys.modules[name]


GOOD = """
    import pp_core
    @pp_core.hookimpl
    def pp_register_models(register):
        register("tiny", lambda: None)
"""


def test_entry_point_plugin_is_loaded_with_its_distribution(on_path):
    make_dist(on_path, "pp-tiny", {"ppt_good": GOOD}, {"tiny": "ppt_good"})
    plugins = load_plugins(disabled=())
    assert plugins.models.entry("tiny").plugin == "tiny"
    assert plugins.distribution("tiny") == ("pp-tiny", "1.2.3")
    assert "pp_core_builtins.schedules.gpipe" in dict(plugins.pm.list_name_plugin())


def test_plugin_that_fails_to_import_is_reported_and_others_still_load(on_path, caplog):
    make_dist(on_path, "pp-broken", {"ppt_broken": "import not_a_module_anywhere\n",
                                     "ppt_good": GOOD},
              {"broken": "ppt_broken", "tiny": "ppt_good"})
    with caplog.at_level("WARNING", logger="pp_core.plugin_manager"):
        plugins = load_plugins(disabled=())
    [broken] = [b for b in plugins.broken if b.name == "broken"]
    message = broken.message()
    assert [r.getMessage() for r in caplog.records] == [message]  # it reaches the log too
    assert "plugin 'broken' (pp-broken 1.2.3) failed to import" in message
    assert "No module named 'not_a_module_anywhere'" in message
    assert "PP_CORE_DISABLE_PLUGINS=broken" in message
    assert "tiny" in plugins.models


def test_misspelled_hook_names_the_plugin_and_suggests_the_hook(on_path):
    source = """
        import pp_core
        @pp_core.hookimpl
        def pp_register_schedule(register):
            pass
    """
    make_dist(on_path, "pp-typo", {"ppt_typo": source}, {"typo": "ppt_typo"})
    pm = make_plugin_manager(disabled=())  # the others load: it is left out, listed as broken
    [broken] = [b for b in pm.broken if b.name == "typo"]
    assert "plugin 'typo' (pp-typo 1.2.3) failed validation" in broken.message()
    assert "implements unknown hook 'pp_register_schedule'; did you mean " \
        "'pp_register_schedules'" in broken.message()
    assert pm.get_plugin("typo") is None and pm.get_plugin("pp_core_builtins.schedules.gpipe")


def test_disabled_plugin_is_not_imported(on_path, monkeypatch):
    make_dist(on_path, "pp-broken", {"ppt_broken": "raise SystemError('boom')\n"},
              {"broken": "ppt_broken"})
    monkeypatch.setenv("PP_CORE_DISABLE_PLUGINS", "broken, pp_core_builtins.schedules.gpipe")
    plugins = load_plugins()
    assert not [b for b in plugins.broken if b.name == "broken"]
    assert "gpipe" not in plugins.schedules
    assert "1f1b" in plugins.schedules


def test_duplicate_schedule_name_names_both_plugins():
    class Clash:
        @hookimpl
        def pp_register_schedules(self, register):
            register("GPipe", ScheduleDef(generate=lambda *a: []))

    plugins = plugins_with("pp_core_builtins.schedules.gpipe", ("clash", Clash()))
    with pytest.raises(PluginError, match=r"schedule 'GPipe' is registered twice: by plugin "
                                          r"'pp_core_builtins.schedules.gpipe' \(as 'gpipe'\) "
                                          r"and by plugin 'clash'"):
        plugins.schedules


@pytest.mark.parametrize("hook, kind", [("pp_register_splitters", "splitter"),
                                        ("pp_register_models", "model"),
                                        ("pp_register_datasets", "dataset")])
def test_duplicate_names_in_every_registry(hook, kind):
    def make(name):
        class Plugin:
            pass
        setattr(Plugin, hook, hookimpl(lambda self, register: register("thing", object())))
        return (name, Plugin())

    plugins = plugins_with(make("first"), make("second"))
    with pytest.raises(PluginError, match=rf"{kind} 'thing' is registered twice: by plugin "
                                          rf"'first' .* and by plugin 'second'"):
        getattr(plugins, f"{kind}s")


def test_unknown_name_lists_installed_ones_with_their_plugin():
    plugins = plugins_with("pp_core_builtins.schedules.gpipe", "pp_core_builtins.schedules.one_f_one_b")
    with pytest.raises(PluginError) as info:
        plugins.schedules.get("gpipee")
    message = str(info.value)
    assert "unknown schedule 'gpipee'; did you mean 'gpipe'?" in message
    assert "gpipe (from pp_core_builtins.schedules.gpipe)" in message
    assert "1f1b (from pp_core_builtins.schedules.one_f_one_b)" in message


def test_names_and_aliases_are_case_insensitive():
    plugins = plugins_with("pp_core_builtins.schedules.gpipe")
    assert plugins.schedules.entry("GPIPE").name == "gpipe"


def test_plugin_raising_in_register_hook_is_named():
    class Raises:
        @hookimpl
        def pp_register_models(self, register):
            raise KeyError("oops")

    with pytest.raises(PluginError, match=r"plugin 'bad' .* raised in pp_register_models: KeyError"):
        plugins_with(("bad", Raises())).models


def test_bare_generator_is_wrapped_in_a_schedule_def():
    class Bare:
        @hookimpl
        def pp_register_schedules(self, register):
            register("mine", lambda num_stages, num_microbatches, num_ranks: [])

    name, definition = resolve_schedule_def("mine", plugins_with(Bare()))
    assert name == "mine" and isinstance(definition, ScheduleDef) and definition.placement == "loop"


def test_plugin_manager_factory_has_no_shared_state():
    first, second = plugins_with(), plugins_with()
    assert first.pm is not second.pm
    assert isinstance(first, Plugins)


def test_an_unknown_disabled_name_is_named_with_the_known_ones(monkeypatch):
    monkeypatch.setenv("PP_CORE_DISABLE_PLUGINS",
                       "pp_core_builtins.schedules.gpipe, pp_core_builtins.schedules.gpip3")
    with pytest.warns(UserWarning, match=r"PP_CORE_DISABLE_PLUGINS: no installed plugin is named "
                                         r"'pp_core_builtins.schedules.gpip3', so it disables "
                                         r"nothing; did you mean 'pp_core_builtins.schedules.gpipe'"
                                         r"\? installed plugins: .*"
                                         r"pp_core_builtins.schedules.gpipe") as caught:
        plugins = load_plugins()
    assert len(caught) == 1 and "gpipe" not in plugins.schedules


def test_a_lazy_callable_imports_its_target_on_first_use_with_its_signature(on_path):
    import copy
    import inspect

    from pp_core import ConfigError
    from pp_core.app.factories import accepts
    from pp_core.callables import LazyCallable

    (on_path / "ppt_heavy.py").write_text(
        "def make(width, *, batch_size=8):\n    return ('made', width, batch_size)\n")
    lazy = LazyCallable("ppt_heavy:make")
    copy.copy(lazy)
    assert "ppt_heavy" not in sys.modules  # registering, copying and showing import nothing
    assert "ppt_heavy:make" in repr(lazy) and "ppt_heavy" not in sys.modules
    # what validation reads of a factory: its parameters (batch_size filled in) and its name
    assert list(inspect.signature(lazy).parameters) == ["width", "batch_size"]
    assert accepts(lazy, "batch_size") and not accepts(lazy, "depth")
    assert lazy.__qualname__ == "make" and "ppt_heavy" in sys.modules
    assert lazy(3) == ("made", 3, 8)
    with pytest.raises(ConfigError, match="cannot import module 'ppt_missing'"):
        LazyCallable("ppt_missing:make")()
