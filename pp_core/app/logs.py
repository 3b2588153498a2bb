"""Where the application sends log records: the library only logs, ``pp-core`` decides.

Library modules log to ``logging.getLogger(__name__)`` (a plugin that failed to load or to take
metrics, a failed step, a slow step) and never configure handlers. The command line and each
rank process of ``pp-core run`` route records to stderr, prefixed so that a rank's lines can be
told apart, from ``$PP_CORE_LOG_LEVEL`` up (default ``WARNING``).
"""

from __future__ import annotations

import logging
import os

from pp_core.errors import ConfigError

__all__ = ["LOG_LEVEL_ENV", "configure_logging"]

LOG_LEVEL_ENV = "PP_CORE_LOG_LEVEL"


def configure_logging(prefix: str = "pp-core") -> None:
    """Log records (pp-core's, plugins', torch's) to stderr as ``<prefix>: LEVEL: logger:
    message``; a process that configured logging already keeps its own setup."""
    name = os.environ.get(LOG_LEVEL_ENV, "WARNING").strip().upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ConfigError(f"{LOG_LEVEL_ENV}={name!r} is not a logging level; use DEBUG, INFO, "
                          f"WARNING or ERROR, or unset it")
    logging.basicConfig(level=level, format=f"{prefix}: %(levelname)s: %(name)s: %(message)s")
