"""``pp-core schedule ...``, ``pp-core plugins`` and the help screens never import torch.

The schedule half is pure Python, but every command loads every installed plugin, so one plugin
module that imports torch at import time costs a schedule command seconds. Each case runs the
environment's own ``pp-core`` script in a fresh interpreter under ``-X importtime`` and reads
which modules it imported; on failure the message names the chain that pulled torch in.
``pp-core plugins`` registers every plugin's splitters and models too: pp-core's own register
theirs without torch or transformers (a third party's plugin may not, so those are left out).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest

from tests.cases.cli import PP_CORE

COMMANDS = {
    "help": ["--help"],
    "schedule-help": ["schedule", "--help"],
    "show": ["schedule", "show", "{tmp}/pipe.yaml"],  # a pipeline file: read as YAML alone
    "show-svg": ["schedule", "show", "zero_bubble", "--pp", "2", "--microbatches", "4",
                 "-o", "{tmp}/zb.svg"],
    "simulate": ["schedule", "simulate", "interleaved_1f1b", "--pp", "2", "--microbatches", "4",
                 "--json", "--trace", "{tmp}/trace.json"],
    "export": ["schedule", "export", "v_schedule", "--pp", "2", "--microbatches", "4"],
    "csv": ["schedule", "simulate", "--csv", "{tmp}/order.csv"],
}


def imported_modules(stderr: str) -> list[tuple[int, str]]:
    """``(depth, module)`` per ``-X importtime`` line, in the order the lines were printed (a
    module's line comes after those of the modules it imported, one level deeper)."""
    rows = []
    for line in stderr.splitlines():
        if line.startswith("import time:") and not line.rstrip().endswith("imported package"):
            name = line.rsplit("|", 1)[1]
            rows.append(((len(name) - len(name.lstrip())) // 2, name.strip()))
    return rows


def importers_of(module: str, rows: list[tuple[int, str]]) -> list[str] | None:
    """``[module, its importer, ..., the top-level import]``, or ``None`` if never imported."""
    where = next((i for i, (_, name) in enumerate(rows) if name == module), None)
    if where is None:
        return None
    depth, chain = rows[where][0], [module]
    for level, name in rows[where + 1:]:
        if level < depth:
            depth = level
            chain.append(name)
    return chain


def run_importtime(argv: list[str], env: dict) -> tuple[subprocess.CompletedProcess, list]:
    """Run ``pp-core *argv`` under ``-X importtime``: the process and its imported modules."""
    done = subprocess.run([sys.executable, "-X", "importtime", PP_CORE, *argv],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = imported_modules(done.stderr)
    assert any(name == "pp_core.app.cli" for _, name in rows)  # -X importtime saw the command run
    return done, rows


@pytest.mark.cli
@pytest.mark.parametrize("case", list(COMMANDS))
def test_schedule_command_does_not_import_torch(case, tmp_path):
    (tmp_path / "order.csv").write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    (tmp_path / "pipe.yaml").write_text("model: {name: gpt}\ndata: {name: synthetic}\n"
                                        "pipeline: {pp_batch_size: 4}\ndistributed: {pp_size: 2}\n")
    argv = [arg.format(tmp=tmp_path) for arg in COMMANDS[case]]
    env = {k: v for k, v in os.environ.items() if k != "PP_CORE_DISABLE_PLUGINS"}
    _, rows = run_importtime(argv, env)
    chain = importers_of("torch", rows)
    assert chain is None, (f"'pp-core {' '.join(argv)}' imported torch: "
                           f"{' <- '.join(chain)}; import torch lazily there")


def third_party_plugins() -> list[str]:
    """The installed plugins that are not pp-core's own (the example plugin, once
    tests/plugins/test_example_plugin.py installed it, registers a model class that needs torch)."""
    return sorted(ep.name for ep in metadata.entry_points(group="pp_core")
                  if not ep.name.startswith("pp_core_builtins."))


@pytest.mark.cli
def test_plugins_listing_does_not_import_torch():
    env = {**os.environ, "PP_CORE_DISABLE_PLUGINS": ",".join(third_party_plugins())}
    done, rows = run_importtime(["plugins"], env)
    for heavy in ("torch", "transformers"):
        chain = importers_of(heavy, rows)
        assert chain is None, (f"'pp-core plugins' imported {heavy}: {' <- '.join(chain)}; "
                               f"register splitters and models without it, import it lazily")
    # the listing is whole all the same: every built-in's splitters, models and datasets
    listing = done.stdout
    for line in ("splitters: hf_decoder", "models: hf_causal_lm", "splitters: balanced",
                 "splitters: fqn", "splitters: layers", "splitters: sequential",
                 "models: gpt, uneven_gpt, moe_gpt",
                 "datasets: synthetic, text_bytes, tokenized_text"):
        assert line in listing, listing


def test_importers_of_names_the_chain():
    stderr = ("import time: self [us] | cumulative | imported package\n"
              "import time:   1 |   1 |     torch._C\n"
              "import time:   1 |   2 |   torch\n"
              "import time:   1 |   1 |   other\n"
              "import time:   1 |   4 | my_plugin\n")
    rows = imported_modules(stderr)
    assert importers_of("torch", rows) == ["torch", "my_plugin"]
    assert importers_of("numpy", rows) is None
