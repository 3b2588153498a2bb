"""Shared fixtures and the two tiers.

A test module that runs cases on gloo ranks says how many with ``pytestmark =
pytest.mark.ranks(N)`` (``timeout=`` as :class:`pp_core.testing.DistPool` takes it) and asks for
the ``pool`` fixture: one pool of N spawned ranks, shared by its cases and by the other modules
of N ranks (``pools(N)`` gets one in a test of its own), because starting ranks (importing torch
N times) costs more than most cases. Tests that start ranks any other way carry ``ranks`` too,
and tests that run ``pp-core`` (or any Python) in a subprocess carry ``cli``; ``scripts/test.sh
--fast`` runs everything else (``-m "not ranks and not cli"``) and fails a test that starts a
process without saying so (:class:`_refusing_processes`).
"""

import os

import pytest

from pp_core.testing import plugin_manager


@pytest.fixture
def pm():
    """A fresh plugin manager with no entry points loaded: tests add exactly what they need."""
    return plugin_manager()


_POOLS: dict = {}  # world size -> the live DistPool of that many ranks, least recently used first
_POOLED_RANKS = 8  # live ranks kept between modules (idle ranks hold memory, not CPU)


def shared_pool(*args, **kwargs):
    """``DistPool(*args, **kwargs)``, shared: the live pool of as many ranks, set to these
    timeouts, or a new one (kept while the ranks of the pools kept stay within
    ``_POOLED_RANKS``). Starting N ranks - N processes importing torch - cost 3-6 s per module
    on a 2-core machine, for ~40 modules. A case finds the ranks as the previous case left
    them, whichever module ran it: DistPool renews the process group after a failure and
    restarts dead or hung ranks, and a case seeds what it draws rather than rely on the ranks'
    fresh state. Never closed by a test: pytest closes them at the end of the session."""
    import inspect

    from pp_core.testing import DistPool  # lazy: torch, which a schedule-only run never needs

    wanted = inspect.signature(DistPool).bind(*args, **kwargs)
    wanted.apply_defaults()
    settings = dict(wanted.arguments)
    world = settings.pop("world_size")
    ranks = _POOLS.pop(world, None)
    if ranks is None:
        while _POOLS and sum(_POOLS) + world > _POOLED_RANKS:
            _POOLS.pop(next(iter(_POOLS))).close()  # the least recently used
        ranks = DistPool(world, **settings)
    for name, value in settings.items():  # the caller's timeouts
        setattr(ranks, name, value)
    _POOLS[world] = ranks  # the most recently used, last
    return ranks


@pytest.fixture(scope="session")
def pools():
    """:func:`shared_pool`, for a module that needs pools of several sizes (``pools(2)``,
    ``pools(4, timeout=180)``) or a pool in one test only."""
    return shared_pool


@pytest.fixture(scope="module")
def pool(request):
    """The module's ranks: ``DistPool(*args, **kwargs)`` of its ``ranks`` marker, shared with
    the other modules of as many ranks (:func:`shared_pool`)."""
    marker = request.node.get_closest_marker("ranks")
    if marker is None or not marker.args:
        raise pytest.UsageError(f"{request.node.nodeid} uses the pool fixture without saying how "
                                f"many ranks: add pytestmark = pytest.mark.ranks(N)")
    return shared_pool(*marker.args, **marker.kwargs)


def pytest_sessionfinish(session):
    while _POOLS:
        _POOLS.popitem()[1].close()


def pytest_collection_modifyitems(items):
    """A test that takes a pool of ranks (``pool``, or a module's own ``pool2``/``pools``...)
    starts processes: it is marked ``ranks`` without saying so twice."""
    for item in items:
        if any(name.startswith("pool") for name in getattr(item, "fixturenames", ())):
            if item.get_closest_marker("ranks") is None:
                item.add_marker("ranks")


_QUICK_TOOLS = {"mount", "umount"}  # a tmpfs for the full-disk tests: milliseconds, no Python


class UnmarkedProcess(Exception):
    """A test of the fast tier started a process: it belongs to the ``ranks`` or ``cli`` tier."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _refusing_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _refusing_processes(item):
        return (yield)


class _refusing_processes:
    """Under ``scripts/test.sh --fast`` (``PP_CORE_FAST_TIER=1``), a test without a ``ranks`` or
    ``cli`` marker that starts a process fails at once naming the marker it needs, so the fast
    tier stays fast as tests are added. The full suite runs as written."""

    def __init__(self, item):
        self.active = (os.environ.get("PP_CORE_FAST_TIER") == "1"
                       and item.get_closest_marker("ranks") is None
                       and item.get_closest_marker("cli") is None)
        self.nodeid = item.nodeid

    def __enter__(self):
        if not self.active:
            return self
        import multiprocessing.process
        import subprocess

        self.saved = subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start
        execute, nodeid = self.saved[0], self.nodeid

        def refuse(what):
            raise UnmarkedProcess(f"{nodeid} starts {what} but is marked neither ranks nor cli: "
                                  f"add @pytest.mark.cli (a subprocess) or @pytest.mark.ranks "
                                  f"(processes or a process group), so --fast leaves it out")

        def execute_child(popen, args, *rest, **kwargs):
            command = [str(a) for a in ([args] if isinstance(args, (str, bytes)) else args)]
            if command and os.path.basename(command[0]) in _QUICK_TOOLS:
                return execute(popen, args, *rest, **kwargs)
            refuse(f"a subprocess ({' '.join(command)[:120]})")

        def start(process):
            refuse("a multiprocessing process")

        subprocess.Popen._execute_child = execute_child
        multiprocessing.process.BaseProcess.start = start
        return self

    def __exit__(self, *exc):
        if self.active:
            import multiprocessing.process
            import subprocess

            subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start = self.saved
