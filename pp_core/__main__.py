"""``python -m pp_core`` is the ``pp-core`` command."""

import sys

from pp_core.app.cli import main

sys.exit(main())
