"""Compatibility path, kept so that code written against it keeps working: the module moved
to :mod:`pp_core.planning.split` (issue 12, the layout); new code imports from there."""

from pp_core.planning.split import *  # noqa: F401,F403
from pp_core.planning.split import __all__  # noqa: F401
