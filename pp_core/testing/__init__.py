"""Helpers for testing pp-core plugins and pipelines, for plugin authors and pp-core's own tests.

Two jobs, two modules: :mod:`pp_core.testing.plugins` builds plugin managers holding exactly the
plugins a test names (``plugins_with``); :mod:`pp_core.testing.dist_pool` runs test functions on
N local gloo ranks (``DistPool``). Both are importable from here.
"""

from pp_core.lazy import lazy_face
from pp_core.testing.plugins import installed_entry_point, plugin_manager, plugins_with

__all__ = ["plugin_manager", "plugins_with", "installed_entry_point", "DistPool", "Outcome",
           "RankError"]

# Lazy: DistPool imports torch; plugin-manager tests (and `pp-core plugins`) need not.
__getattr__, __dir__ = lazy_face(__name__, dict.fromkeys(("DistPool", "Outcome", "RankError"),
                                                         ".dist_pool"))
