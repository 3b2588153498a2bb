"""Count the function calls a piece of code makes: a machine-independent measure of work, so a
complexity test cannot fail because the machine is loaded (times belong in benchmarks/)."""

import sys


def count_calls(fn, *args) -> int:
    """Python and C function calls made while running ``fn(*args)``."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return calls
