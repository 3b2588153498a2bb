"""``train.activation_checkpointing`` and ``train.compile``: the YAML keys, the helpers they call
(per block, names unchanged), Hugging Face's ``gradient_checkpointing`` as the same switch, the
example pipeline (validate and a short run), and a tied-embedding HF model on a V schedule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pp_core import ConfigError
from pp_core.parallel import (ParallelSettings, apply_activation_checkpointing, find_blocks,
                              parallelize)
from pp_core.app.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/v_schedule_ac_compile.yaml"
BASE = {"model": {"name": "gpt"}, "data": {"name": "synthetic"}}


def _train(**train):
    return parse_spec({**BASE, "train": train}).train


def test_yaml_keys_default_off_and_normalise():
    train = _train()
    assert train.activation_checkpointing == {"mode": "none", "every": 1}
    assert train.compile == {"enabled": False}
    assert _train(activation_checkpointing="Full").activation_checkpointing == \
        {"mode": "full", "every": 1}
    assert _train(activation_checkpointing={"mode": "selective", "every": 2}
                  ).activation_checkpointing == {"mode": "selective", "every": 2}
    assert _train(compile=True).compile == {"enabled": True}
    assert _train(compile={"mode": "max-autotune"}).compile == \
        {"enabled": True, "mode": "max-autotune"}


@pytest.mark.parametrize("train,key", [
    ({"activation_checkpointing": {"mode": "sometimes"}}, "train.activation_checkpointing"),
    ({"activation_checkpointing": {"mode": "full", "every": 0}},
     "train.activation_checkpointing"),
    ({"compile": {"enabled": "yes"}}, "train.compile"),
    ({"compile": {"fullgrpah": True}}, "train.compile"),
])
def test_yaml_keys_reject_bad_values_naming_the_key(train, key):
    with pytest.raises(SpecError, match=rf"{key}: expected"):
        parse_spec({**BASE, "train": train})


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


class Layered(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Counted() for i in range(4)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def test_every_nth_block_is_checkpointed_in_place_and_names_do_not_change():
    model = Layered()
    keys = list(model.state_dict())
    assert apply_activation_checkpointing([model], "full", every=2) == ["layers.0", "layers.2"]
    assert list(model.state_dict()) == keys
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert [b.calls for b in model.layers.values()] == [2, 1, 2, 1]  # recompute where wrapped


def test_a_part_without_blocks_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"no blocks .* `layers` ModuleList/ModuleDict"):
        find_blocks(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"mode: expected one of none, full, selective"):
        apply_activation_checkpointing([Layered()], "partial")


def test_compile_helper_keeps_names_and_gradients():
    torch.manual_seed(0)
    eager, compiled = Layered(), Layered()
    compiled.load_state_dict(eager.state_dict())
    keys = list(compiled.state_dict())
    done = parallelize([compiled], None, ParallelSettings(activation_checkpointing="selective",
                                                          compile={"backend": "aot_eager"}))
    assert done.compiled == done.checkpointed == [f"layers.{i}" for i in range(4)]
    assert list(compiled.state_dict()) == keys
    x = torch.randn(3, 4)
    eager(x).sum().backward()
    compiled(x).sum().backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_hf_gradient_checkpointing_is_the_same_switch():
    pytest.importorskip("transformers")
    from pp_core.app.rank import activation_checkpointing_of
    from tests.cases.hf import tiny_model

    model = tiny_model("llama", 2)
    (getattr(model, "activation_checkpointing_enable", None)
     or model.gradient_checkpointing_enable)()
    spec = parse_spec({**BASE})
    assert activation_checkpointing_of(spec, model) == {"mode": "full", "every": 1}
    assert not any(getattr(m, "gradient_checkpointing", False)
                   for m in model.modules())  # one mechanism: pp-core's
    spec = parse_spec({**BASE, "train": {"activation_checkpointing": "selective"}})
    assert activation_checkpointing_of(spec, model)["mode"] == "selective"
    blocks = find_blocks(model)
    assert [name for name, _ in blocks] == ["model.layers.0", "model.layers.1"]


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pp_core", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.cli
def test_validate_reports_the_combination(capsys):
    """The command in this process (cli.main): no interpreter importing transformers for it;
    the run below is the example end to end."""
    from pp_core.app import cli

    code = cli.main(["validate", str(ROOT / EXAMPLE)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "activation checkpointing full (every block), compile on" in out


@pytest.mark.cli
@pytest.mark.ranks
def test_the_example_runs_two_steps(tmp_path):
    """``pp-core run`` of the example; the aot_eager backend keeps it short (the inductor run of
    the same pipeline is in test_parallel_matrix and docs/benchmarks.md)."""
    result = _cli("run", EXAMPLE, "--set", "train.steps=2", "--set", "train.log_every=1",
                  "--set", "train.compile.backend=aot_eager", "--set", "output.progress=plain",
                  "--set", f"output.metrics={tmp_path / 'metrics.jsonl'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2/2" in result.stdout


@pytest.mark.ranks
def test_hf_tied_llama_with_ac_and_compile_on_a_v_schedule(pools):
    pytest.importorskip("transformers")
    from tests.cases.parallel import hf_case

    pool = pools(2, timeout=300)
    for ac, backend in (("full", None), ("selective", "aot_eager")):
        results = pool.run(hf_case, "v_schedule", ac, backend)
        assert sum(r["loss_err"] is not None for r in results) == 1
        for result in results:
            assert result["worst"] <= 1e-5, (ac, backend, result)
            assert result["loss_err"] is None or result["loss_err"] <= 1e-5


def _split_backward_calls(wrap) -> int:
    from pp_core.runtime.backward import backward_input, backward_weight

    torch.manual_seed(0)
    block = Counted()
    wrap(block)
    x = torch.randn(2, 4, requires_grad=True)
    out = block(x)
    _, state = backward_input([out], [torch.ones_like(out)], [x])
    backward_weight(state)
    return block.calls


def test_split_backward_recomputes_a_checkpointed_block_once_torch_checkpoint_twice():
    from torch.utils.checkpoint import checkpoint

    from pp_core.parallel import checkpoint_block

    def torch_wrap(block):
        inner = block.forward
        block.forward = lambda x: checkpoint(inner, x, use_reentrant=False)

    assert _split_backward_calls(checkpoint_block) == 2  # forward + one recompute
    assert _split_backward_calls(torch_wrap) == 3  # forward + one per graph task (I, then W)


def test_recompute_runs_in_the_forwards_autocast_state():
    torch.manual_seed(0)
    model, reference = Layered(), Layered()
    reference.load_state_dict(model.state_dict())
    apply_activation_checkpointing([model], "full")
    x = torch.randn(2, 4)
    for module in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        out.float().sum().backward()
    for (name, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


class Remembers(nn.Module):
    """Keeps a weak reference to the activation it saves for backward, on every call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        hidden = self.lin(x)
        self.seen.append(__import__("weakref").ref(hidden))
        return torch.tanh(hidden) * hidden


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
def test_recomputed_activations_are_freed_after_backward(split):
    import gc

    from pp_core.parallel import checkpoint_block
    from pp_core.runtime.backward import backward_full, backward_input, backward_weight

    block = checkpoint_block(Remembers())
    x = torch.randn(2, 4, requires_grad=True)
    out = block(x)
    if split:
        _, state = backward_input([out], [torch.ones_like(out)], [x])
        backward_weight(state)
        del state
    else:
        backward_full([out], [torch.ones_like(out)], [x])
    del out
    gc.collect()
    assert len(block.seen) == 2  # forward + recompute
    assert all(ref() is None for ref in block.seen), "a recomputed activation outlived backward"
