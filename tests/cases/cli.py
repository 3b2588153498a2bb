"""The ``pp-core`` script of the environment running the tests.

Tests that run the command must run *this* one (or ``sys.executable -m pp_core``): a bare
``"pp-core"`` is looked up on PATH, which may hold another installation or none at all
(``scripts/test.sh`` does not put ``.venv/bin`` on PATH).
"""

import sysconfig
from pathlib import Path

PP_CORE = str(Path(sysconfig.get_path("scripts")) / "pp-core")
