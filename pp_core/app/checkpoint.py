"""Compatibility path, kept because docs/yaml.md told users to import it: the checkpoint functions
moved down into the library as :mod:`pp_core.checkpoint` (issue 30); new code imports from there."""

from pp_core.checkpoint import *  # noqa: F401,F403
from pp_core.checkpoint import __all__  # noqa: F401
