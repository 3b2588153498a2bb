"""Helpers shared by the hand-run benchmarks: peak resident memory, the JSON report.

torch's CPU allocations are invisible to tracemalloc, so the benchmarks read ``/proc/self/status``
instead: ``VmRSS`` now, ``VmHWM`` the peak since the last :func:`reset_peak`.
"""


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``"VmRSS"``, ``"VmHWM"``) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current resident set (``clear_refs`` 5, Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def write_json(path, data, indent: int = 1) -> str:
    """The figures as JSON text, also written to ``path`` when one is given (``--json FILE``).

    Every benchmark prints its figures and may keep them in a file; one writer keeps the format
    (indent, trailing newline) the same across them.
    """
    import json

    text = json.dumps(data, indent=indent)
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return text


def seeded_gpt(model: dict):
    """The built-in GPT with ``model``'s sizes, its weights drawn from seed 0 (the same every run)."""
    import torch
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(**model)


def random_batch(vocab_size: int, batch: int, seq: int):
    """One (inputs, targets) batch of random token ids from seed 1: what the timing needs, no corpus."""
    import torch

    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    y = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    return x, y


def options(doc: str, **defaults):
    """A command-line parser with one ``--name`` a default (``seq_len`` is ``--seq-len``), typed
    by the default (``None``: a string, e.g. ``json=None`` for ``--json FILE``); the docstring's
    first line is its description. A benchmark adds its special options to the parser it returns.
    """
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        if isinstance(default, bool):
            raise TypeError(f"{name}: a flag is added by hand (action='store_true')")
        parser.add_argument("--" + name.replace("_", "-"), default=default,
                            type=str if default is None else type(default))
    return parser
