"""Compatibility path, kept so that code written against it keeps working: the module moved
to :mod:`pp_core.schedule.buffer_plan` (issue 12, the layout); new code imports from there."""

from pp_core.schedule.buffer_plan import *  # noqa: F401,F403
from pp_core.schedule.buffer_plan import __all__  # noqa: F401
