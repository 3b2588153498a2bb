"""Compatibility path, kept so that code written against it keeps working: the module moved
to :mod:`pp_core.plugin_manager` (issue 12, the layout); new code imports from there."""

from pp_core.plugin_manager import *  # noqa: F401,F403
from pp_core.plugin_manager import __all__  # noqa: F401
