"""moe_gpt on one process: dropless routing equals a token-by-token computation, one dispatch
workspace per rank whatever the number of MoE layers, and two layers sharing the workspace key
with different signatures are refused naming both."""

import pytest
import torch
from torch import nn

from pp_core.runtime import collect_pipeline_runtime_initializers
from pp_core.parallel.expert import reset_workspaces, workspace_for
from pp_core_builtins.models.moe_gpt import MoE, MoEGPT


def test_dropless_routing_equals_token_by_token():
    torch.manual_seed(0)
    moe = MoE(8, num_experts=4, top_k=2, hidden=12, shared_expert=True).eval()
    for param in moe.parameters():
        nn.init.normal_(param, std=0.3)
    x = torch.randn(3, 5, 8)
    out = moe(x)
    probs = moe.router(x.reshape(-1, 8)).softmax(-1)
    weights, chosen = probs.topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    want = moe.shared(x.reshape(-1, 8))
    for t, row in enumerate(x.reshape(-1, 8)):
        for w, e in zip(weights[t], chosen[t]):
            hidden = nn.functional.gelu(row @ moe.experts.w1[e])
            want[t] = want[t] + w * (hidden @ moe.experts.w2[e])
    torch.testing.assert_close(out.reshape(-1, 8), want, atol=1e-6, rtol=1e-5)


def test_one_workspace_per_rank_whatever_the_number_of_moe_layers():
    for layers in (1, 3):
        model = MoEGPT(vocab_size=16, dim=8, num_layers=layers, num_heads=2, max_seq_len=4,
                       num_experts=4, top_k=2)
        found = collect_pipeline_runtime_initializers([model])
        assert len(found) == 1 and found[0].signature == (8, "float32", 2, 4, 1)
    reset_workspaces()
    found[0].prepare(num_tokens=6, device=torch.device("cpu"))
    found[0].prepare(5, torch.device("cpu"))  # positional, as the seed's executor calls it
    workspace = workspace_for(found[0].resource_key, found[0].signature)
    assert workspace.prepared == [6, 5] and workspace.grows == 1 and workspace.rows == 16


def test_conflicting_workspace_signatures_are_refused_naming_both():
    part = nn.Sequential(MoE(8, 4, 2, 12), MoE(8, 4, 2, 12).double())
    with pytest.raises(RuntimeError) as error:
        collect_pipeline_runtime_initializers([part])
    message = str(error.value)
    assert "pp_core_builtins.moe.dispatch_workspace" in message
    assert "'0' of model part 0" in message and "'1' of model part 0" in message
    assert "float32" in message and "float64" in message
