"""A third-party MoE model package gives pp-core the expert-parallel plan of its own model through
the entry-point group ``pp_core``, and trains equal to one process at ep 2.

The package (``pp-tinymoe``) is built and pip-installed here from a temporary directory into a
``--target`` folder (the shared environment is left as it was); the ranks put that folder on
``sys.path`` and load the installed plugins afresh, so the entry point is found as it would be
in a user's environment. Its model imports only public pp-core names: ``pp_core.hookimpl`` and
``pp_core.parallel.expert`` (the dispatch, the workspace initializer, the aux-loss injection, the
expert sharding). pp2 x dp2 with ep2 drawn from the dp ranks (4 gloo ranks,
``ParallelDims.build``), two SGD steps: each step's loss and every gradient (an expert's: this ep
rank's slice) equal the unsplit model's on one process over the same microbatches.
"""

from __future__ import annotations

import copy
import re
import sys

import pytest


PLUGIN = '''
"""A mixture-of-experts model and its expert-parallel plan, from outside pp-core."""
import pp_core


@pp_core.hookimpl
def pp_register_models(register):
    from pp_tinymoe.model import TinyMoE

    register("tinymoe", TinyMoE)


@pp_core.hookimpl
def pp_expert_parallel_plan(model):
    if type(model).__name__ != "TinyMoE":
        return None  # pass: not my model
    from pp_tinymoe.model import ShardMyExperts

    return {"layers.*.moe": ShardMyExperts()}
'''

MODEL = '''
import torch
from torch import nn

from pp_core.parallel.expert import (DispatchWorkspaceInitializer, dispatch_to_experts,
                                     group_name, inject_aux_loss, shard_stacked_experts,
                                     workspace_for)

WORKSPACE = "pp_tinymoe.dispatch_workspace"


class Experts(nn.Module):
    def __init__(self, num_experts, dim):
        super().__init__()
        self.w = nn.Parameter(torch.randn(num_experts, dim, dim) * 0.3)

    def forward(self, rows, counts):
        outs = [torch.tanh(chunk @ self.w[e]) for e, chunk in enumerate(torch.split(rows, counts))
                if chunk.shape[0]]
        return torch.cat(outs) if outs else rows.new_zeros((0, rows.shape[-1])) + 0 * rows.sum()


class MoE(nn.Module):
    def __init__(self, dim, num_experts, top_k):
        super().__init__()
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim)
        self.ep_group, self.ep_size = None, 1
        self.pp_aux_losses = []      # the metrics read them (pp_core.losses.pop_aux_losses)
        self.pp_aux_loss_scale = 1.0  # the running step hands it over

    def signature(self):
        return (self.dim, "float32", self.top_k, self.num_experts // self.ep_size, self.ep_size)

    def pipeline_runtime_initializers(self):
        key = (WORKSPACE, group_name(self.ep_group))
        return [DispatchWorkspaceInitializer(key, self.signature())]

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        workspace = workspace_for((WORKSPACE, group_name(self.ep_group)), self.signature())
        out, counts = dispatch_to_experts(x, chosen, weights, self.num_experts, self.experts,
                                          self.ep_group, workspace)
        if self.training and torch.is_grad_enabled():
            share = counts.float() / float(x.shape[0] * self.top_k)
            aux = 0.1 * self.num_experts * (share * probs.mean(dim=0)).sum()
            self.pp_aux_losses.append(aux.detach())
            out = inject_aux_loss(out, aux, self.pp_aux_loss_scale)
        return out.reshape(shape)


class ShardMyExperts:
    def apply(self, module, ep_group):
        shard_stacked_experts(module.experts, ("w",), module.num_experts, ep_group)
        module.ep_group, module.ep_size = ep_group, torch.distributed.get_world_size(ep_group)


class Block(nn.Module):
    def __init__(self, dim, num_experts, top_k):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = MoE(dim, num_experts, top_k)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class TinyMoE(nn.Module):
    def __init__(self, vocab_size=32, dim=8, num_layers=4, num_experts=4, top_k=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, num_experts, top_k)
                                     for i in range(num_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        x = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        return x if self.output is None else self.output(x)
'''

VOCAB, SEQ, LOCAL, STEPS = 32, 6, 4, 2
PARTS = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The package built and pip-installed (no network: setuptools from this environment)."""
    from tests.cases.plugin_packages import install_package

    return install_package(tmp_path_factory.mktemp("tinymoe"), "pp_tinymoe",
                           {"__init__": PLUGIN, "model": MODEL})


def test_the_package_imports_only_public_pp_core_names():
    imported = set(re.findall(r"^\s*(?:from|import) (pp_core\S*)", PLUGIN + MODEL, re.M))
    assert imported == {"pp_core", "pp_core.parallel.expert"}, imported


def _third_party_case(site: str) -> dict:
    import importlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as functional

    from pp_core import PipelineConfig, build_pipeline
    from pp_core.losses import pop_aux_losses
    from pp_core.parallel import ParallelSettings, parallelize
    from pp_core.parallel.dims import ParallelDims
    from pp_core.parallel.expert import aux_loss_modules, scale_aux_losses
    from pp_core.plugin_manager import load_plugins

    if site not in sys.path:
        sys.path.insert(0, site)
        importlib.invalidate_caches()
    plugins = load_plugins()  # the entry points as installed, pp_tinymoe's among them
    meshes = ParallelDims(pp=2, dp_shard=2, ep=2).build("cpu")
    torch.manual_seed(0)
    model = plugins.models.get("tinymoe")(vocab_size=VOCAB)
    reference = copy.deepcopy(model)
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=LOCAL, pp_microbatch_size=1,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True,
                            module_fqns_per_model_part=PARTS)
    pipe = build_pipeline(model, config, meshes=meshes, plugins=plugins)
    sharded = parallelize(pipe, meshes, ParallelSettings(data_parallel="replicate",
                                                         plugins=plugins)).expert_parallel
    params = [p for part in pipe.model_parts for p in part.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    dp_rank, dp_size, ep_rank = meshes.dp_rank, meshes.dims.dp, meshes.experts.ep_rank
    num_mb = dp_size * LOCAL
    layers = aux_loss_modules([reference])
    scale_aux_losses(layers, 1.0 / num_mb)  # what the pipeline's steps hand their layers
    losses, grad_errs, loss_errs = [], [], []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step + 1)
        tokens = torch.randint(0, VOCAB, (num_mb, SEQ + 1), generator=generator)
        inputs, target = tokens[:, :-1], tokens[:, 1:]
        mine = slice(dp_rank * LOCAL, (dp_rank + 1) * LOCAL)
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.step(inputs[mine], target=target[mine])
        reference.zero_grad(set_to_none=True)
        ref_loss = 0.0
        for x, t in zip(inputs.chunk(num_mb), target.chunk(num_mb)):
            value = functional.cross_entropy(reference(x).reshape(-1, VOCAB), t.reshape(-1))
            (value / num_mb).backward()
            ref_loss += value.item() / num_mb
        pop_aux_losses([reference])
        grads = {n: p.grad for n, p in reference.named_parameters()}
        err = 0.0
        for part in pipe.model_parts:
            for name, param in part.named_parameters():
                want = grads[name]
                if getattr(param, "pp_expert_parallel", False):
                    local = want.shape[0] // 2
                    want = want[ep_rank * local:(ep_rank + 1) * local]
                grad = param.grad  # replicate's DTensor: its full value
                grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                err = max(err, (grad - want).abs().max().item())
        grad_errs.append(err)
        if loss is not None:
            dist.all_reduce(loss, group=meshes.data_parallel_mesh().get_group())
            loss_errs.append(abs(loss.item() / dp_size - ref_loss))
            losses.append(ref_loss)
        optimizer.step()
        ref_optimizer.step()
    return {"sharded": sharded, "grad_errs": grad_errs, "loss_errs": loss_errs,
            "losses": losses, "stages": pipe.stage_indices,
            "experts": sorted(n for part in pipe.model_parts for n, p in part.named_parameters()
                              if getattr(p, "pp_expert_parallel", False))}


@pytest.mark.cli
def test_a_third_party_moe_model_trains_at_ep2_equal_to_one_process(site, pools):
    results = pools(4).run(_third_party_case, str(site))
    for rank, result in enumerate(results):
        assert result["sharded"] == 2, result  # two MoE layers on each stage, by the plan
        assert max(result["grad_errs"]) < 1e-5, (rank, result)
        expected = [f"layers.{i}.moe.experts.w" for i in ((0, 1) if rank < 2 else (2, 3))]
        assert result["experts"] == expected, result
    last = [r for r in results if r["stages"] == (1,)]
    assert len(last) == 2 and all(max(r["loss_errs"]) < 1e-5 for r in last), last
    assert last[0]["losses"][1] != last[0]["losses"][0]  # the second step saw trained weights
