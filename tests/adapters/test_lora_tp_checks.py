"""What tensor parallelism cannot shard of a LoRA model is refused before any process starts, in
one line naming the key and the fix (:func:`pp_core.parallel.lora_tp.adapter_problems`, through
``check_tensor_parallel``: ``pp-core validate`` and ``apply_tensor_parallel`` alike); what it can
shard validates. The multi-rank runs are tests/adapters/test_lora_tp.py.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("peft")

from tests.adapters.test_lora_tp import TwoLayers  # noqa: E402


def _blocks():
    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.attn = TwoLayers()
            self.mlp = TwoLayers()
            self.norm = torch.nn.LayerNorm(8)

    return Blocks()


def _problems(plan: dict, **settings) -> list[str]:
    from pp_core.app.adapters import apply_adapters
    from pp_core.parallel.tensor_parallel import check_tensor_parallel

    lora = {"r": 2, "alpha": 4, "target_modules": ["up", "down"], **settings}
    return check_tensor_parallel(apply_adapters(_blocks(), lora, None), plan, 2)


@pytest.mark.parametrize("case", ["covered", "dora", "unplanned", "sequence", "style",
                                  "embedding", "saved"])
def test_what_tp_cannot_shard_is_one_line_naming_the_key(case):
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    plan = {"attn.up": ColwiseParallel(), "attn.down": RowwiseParallel(),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    cases = {
        "covered": ({}, {}, None),
        "dora": ({}, {"use_dora": True},
                 r"adapts attn.up, attn.down, mlp.up and 1 more with DoraLinearVariant .*"
                 r"use_dora: false"),
        "unplanned": ({"mlp.down": None}, {}, r"model.lora trains mlp.down, which the "
                      r"tensor-parallel plan does not cover, beside layers the plan shards"),
        "sequence": ({"mlp.up": None, "mlp.down": None, "norm": SequenceParallel()}, {},
                     r"trains mlp.up, mlp.down, which .* under sequence parallelism"),
        "style": ({"attn.up": PrepareModuleInput()}, {}, r"gives PrepareModuleInput"),
        "embedding": ({"embed": RowwiseParallel()}, {"target_modules": ["up", "embed"]},
                      r"adapts embed \(Embedding\).*leave 'embed' out of "
                      r"model.lora.target_modules"),
        "saved": ({}, {"modules_to_save": ["attn.down"], "target_modules": ["up"]},
                  r"modules_to_save trains copies of attn.down"),
    }
    changes, settings, message = cases[case]
    for key, style in changes.items():
        plan.pop(key, None)
        if style is not None:
            plan[key] = style
    problems = _problems(plan, **settings)
    if message is None:
        assert problems == []
        return
    assert len(problems) == 1 and problems[0].startswith("distributed.tp_size: "), problems
    assert re.search(message, problems[0]), problems[0]
    assert "distributed.tp_size: 1" in problems[0]


def test_dora_is_refused_at_once_and_lora_validates_at_tp2():
    from pp_core.app.adapters import apply_adapters
    from pp_core.app.check import preflight
    from pp_core.app.spec import SpecError, apply_overrides, parse_spec
    from pp_core.errors import ConfigError
    from tests.cases.specs import tiny_gpt_spec

    with pytest.raises(ConfigError, match=r"model.lora.use_dora with distributed.tp_size=2"):
        apply_adapters(TwoLayers(), {"r": 2, "target_modules": ["up"], "use_dora": True}, None,
                       tp_size=2)
    base = tiny_gpt_spec(model={"args": {"vocab_size": 32, "dim": 16, "num_layers": 4,
                                         "num_heads": 2, "max_seq_len": 8},
                                "lora": {"r": 4, "alpha": 8}},
                         distributed={"device": "cpu", "pp_size": 2, "tp_size": 2})
    checked = preflight(parse_spec(base, "lora_tp.yaml"), run_checks=False)
    assert any("modules sharded 2 ways" in note for note in checked.notes), checked.notes
    with pytest.raises(SpecError, match=r"model.lora.use_dora"):
        preflight(parse_spec(apply_overrides(base, ["model.lora.use_dora=true"]), "x.yaml"),
                  run_checks=False)
