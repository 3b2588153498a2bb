"""``launch`` as ``pp-core run`` calls it: ranks forked warm from the fork server.

``pp-core run`` starts :mod:`pp_core.app.launch.warm`'s fork server while it checks the file,
and forks each rank from it with torch and the trainer already imported. A test that calls
:func:`pp_core.app.launch.launch` in-process spawned every rank cold instead: a fresh
interpreter importing torch per rank, 2-3 s of a core each on a 2-core machine. The fork
server, started once, serves every launch of the session (it ends with pytest).
"""

from __future__ import annotations


def warm_launch(spec, entrypoint=None, **kwargs):
    """:func:`pp_core.app.launch.launch` with ``warm=True`` (the fork server started if it is
    not running); where the platform has no fork server, the ranks are spawned."""
    from pp_core.app.launch import launch
    from pp_core.app.launch.warm import start

    return launch(spec, entrypoint, warm=start(), **kwargs)
