"""Compatibility path, kept so that code written against it keeps working: the module moved
to :mod:`pp_core.planning.parts` (issue 12, the layout); new code imports from there."""

from pp_core.planning.parts import *  # noqa: F401,F403
from pp_core.planning.parts import __all__  # noqa: F401
