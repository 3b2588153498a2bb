"""What the MoE tests run on every rank: ``moe_gpt`` pipelined over pp2 x dp2 (4 gloo ranks) with
expert parallelism ep2 drawn from the dp ranks, one step per dp rank on its half of the global
batch, compared with the unsplit model on one process over the same microbatches (gradient
accumulation, auxiliary losses injected at the same scale). Module-level functions, picklable
results: they run in DistPool workers.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as functional

from pp_core import PipelineConfig, build_pipeline
from pp_core.parallel import ParallelSettings, parallelize
from pp_core.parallel.expert import aux_loss_modules, reset_workspaces, scale_aux_losses
from pp_core.parallel.expert.dispatch import _WORKSPACES
from pp_core.parallel.gradients import clip_grad_norm, finish_gradients
from pp_core_builtins.models.moe_gpt import MoE, MoEGPT, pop_aux_losses
from tests.cases.compare import full, grad_difference
from tests.cases.meshes import meshes

VOCAB, SEQ, NUM_EXPERTS = 64, 8, 4


def moe_model(num_layers: int = 4, **overrides) -> MoEGPT:
    torch.manual_seed(0)
    args = dict(vocab_size=VOCAB, dim=16, num_layers=num_layers, num_heads=2, max_seq_len=SEQ,
                num_experts=NUM_EXPERTS, top_k=2, moe_hidden=24, shared_expert=True,
                aux_loss_coef=0.1, z_loss_coef=0.01)
    args.update(overrides)
    return MoEGPT(**args)


def starve_experts(model, experts=(2, 3)) -> None:
    """Route no token to ``experts`` (those of ep rank 1): their router logits get -1e4."""
    for module in model.modules():
        if isinstance(module, MoE):
            mask = torch.zeros(module.num_experts)
            mask[list(experts)] = -1e4
            module.router.register_forward_hook(lambda m, i, out, mask=mask: out + mask)


def data(rows: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def reference(model, inputs, target, num_microbatches: int, max_norm):
    """Loss, summed aux loss, norm and (clipped) gradients of one process over every
    microbatch of the global batch, each loss scaled by 1 / their number."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    scale = 1.0 / num_microbatches
    layers = aux_loss_modules([model])
    scale_aux_losses(layers, scale)  # what a pipeline step hands its layers
    try:
        for x, t in zip(inputs.chunk(num_microbatches), target.chunk(num_microbatches)):
            loss = functional.cross_entropy(model(x).reshape(-1, VOCAB), t.reshape(-1))
            (loss * scale).backward()
            total += loss.item() * scale
    finally:
        scale_aux_losses(layers, 1.0)
    aux = sum(a.item() for a in pop_aux_losses([model])) * scale
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf")))
    return total, aux, norm, {n: p.grad.clone() for n, p in model.named_parameters()}


class AllToAllByAction:
    """Counts ``all_to_all_single`` calls by ``(stage, action kind)`` while active (an action
    observer says which action runs)."""

    def __init__(self, pipe):
        from pp_core.runtime.observers import ActionObserver

        counter = self

        class Current(ActionObserver):
            def on_action_start(self, action):
                counter.action = action

        self.pipe, self.observer, self.action, self.counts = pipe, Current(), None, {}

    def __enter__(self):
        self.saved = dist.all_to_all_single

        def counted(*args, **kwargs):
            action = self.action
            key = f"{action.stage}{action.kind.value}" if action is not None else "none"
            self.counts[key] = self.counts.get(key, 0) + 1
            return self.saved(*args, **kwargs)
        dist.all_to_all_single = counted
        self.pipe.add_action_observer(self.observer)
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.saved
        self.pipe.remove_action_observer(self.observer)


def moe_case(schedule: str, pool: bool = False, ep: int = 2, engine: str = "replicate",
             starve: bool = False, max_norm: float | None = 0.05, seq_lens=(SEQ,),
             ac: str = "none") -> dict:
    """One step per entry of ``seq_lens`` of pp2 x dp2 (ep ``ep``); the last step's loss,
    aux loss, gradient norm and clipped gradients vs one process; the workspace's record."""
    run_meshes = meshes(pp=2, dp_shard=2, ep=ep)
    pp_mesh, dp_mesh = run_meshes.pp, run_meshes.data_parallel_mesh()
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    local, micro = 4, 1
    model = moe_model()
    if starve:
        starve_experts(model)
    ref_model = copy.deepcopy(model)
    reset_workspaces()
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local, pp_microbatch_size=micro,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True,
                            pp_recv_buffer_pool=pool, pp_seq_len=SEQ if pool else None)
    # meshes: the step averages the expert gradients over their ranks
    pipe = build_pipeline(model, config, meshes=run_meshes)
    parallelize(pipe, run_meshes, ParallelSettings(  # experts sharded, AC, then the dp engine
        activation_checkpointing=ac, data_parallel="auto" if engine == "fsdp" else "replicate"))
    params = [p for part in pipe.model_parts for p in part.parameters()]
    num_mb = local // micro
    for step, seq in enumerate(seq_lens):
        for param in params:
            param.grad = None
        inputs, target = data(dp_size * local, step + 1)
        inputs, target = inputs[:, :seq], target[:, :seq]
        mine = slice(dp_rank * local, (dp_rank + 1) * local)
        with AllToAllByAction(pipe) as all_to_alls:
            loss = pipe.step(inputs[mine], target=target[mine])
        finish_gradients(params, 1)
        norm = clip_grad_norm(params, max_norm, pp_mesh.get_group(),
                              ep_group=run_meshes.ep_group)
        aux = torch.tensor([sum(a.item() for a in pop_aux_losses(pipe.model_parts))],
                           dtype=torch.float64)
        dist.all_reduce(aux)
        ref_loss, ref_aux, ref_norm, ref_grads = reference(
            ref_model, inputs, target, dp_size * num_mb, max_norm)
    loss_err = None
    if loss is not None:
        dist.all_reduce(loss, group=dp_mesh.get_group())
        loss_err = abs(loss.item() / dp_size - ref_loss)
    grads = grad_difference(pipe.model_parts, ref_grads, expert_ranks=ep,
                            expert_rank=dist.get_rank(run_meshes.ep_group) if ep > 1 else 0)
    assert not grads.missing, f"no gradient for {grads.missing}"
    grad_err, names = grads.worst, grads.names
    expert_grad_zero = all(bool((full(p.grad) == 0).all()) for part in pipe.model_parts
                           for p in part.parameters() if getattr(p, "pp_expert_parallel", False))
    keys = [i.resource_key for i in pipe.initializers]  # the reference has a workspace too
    workspaces = [(_WORKSPACES[k].grows, list(_WORKSPACES[k].prepared), _WORKSPACES[k].rows)
                  for k in keys]
    return {"loss_err": loss_err, "grad_err": grad_err, "names": names,
            "aux_err": abs(aux.item() / (dp_size * num_mb) - ref_aux), "aux": ref_aux,
            "norm_err": abs(norm - ref_norm), "norm": ref_norm, "workspaces": workspaces,
            "moe_layers": sum(isinstance(m, MoE) for p in pipe.model_parts for m in p.modules()),
            "expert_grad_zero": expert_grad_zero, "num_microbatches": num_mb,
            "all_to_alls": all_to_alls.counts, "stages": pipe.stage_indices}


def hf_moe_case(schedule: str, model_type: str = "qwen3_moe") -> dict:
    """A tiny HF MoE decoder (random weights) split by ``hf_decoder``, ep 2 through the plan
    hook, pp2 x dp2: loss and every gradient vs the unsplit model on one process."""
    from pp_core_builtins.transformers import causal_lm_loss
    from tests.cases.hf import batch as hf_batch, reference_step, tiny_model

    run_meshes = meshes(pp=2, dp_shard=2, ep=2)
    dp_mesh = run_meshes.data_parallel_mesh()
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    extra = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               decoder_sparse_step=1, norm_topk_prob=True),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}[model_type]
    model = tiny_model(model_type, 4, **extra)
    ref_model = copy.deepcopy(model)
    local = 4
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local, pp_microbatch_size=1,
                            loss_fn=causal_lm_loss, scale_grads_in_schedule=True)
    # meshes: the token-exact loss counts the valid tokens over the dp ranks (docs/data.md)
    pipe = build_pipeline(model, config, meshes=run_meshes)
    sharded = parallelize(pipe, run_meshes,
                          ParallelSettings(data_parallel="replicate")).expert_parallel
    params = [p for part in pipe.model_parts for p in part.parameters()]
    inputs, target = hf_batch(dp_size * local, seed=1)
    mine = slice(dp_rank * local, (dp_rank + 1) * local)
    loss = pipe.step({k: v[mine] for k, v in inputs.items()}, target=target[mine])
    finish_gradients(params, 1)
    n = dp_size * local
    ref_loss, ref_grads = reference_step(ref_model, inputs, target, n)
    loss_err = None
    if loss is not None:
        dist.all_reduce(loss, group=dp_mesh.get_group())
        loss_err = abs(loss.item() / dp_size - float(ref_loss))
    grads = grad_difference(pipe.model_parts, ref_grads, factor=1 / n, expert_ranks=2,
                            expert_rank=dist.get_rank(run_meshes.ep_group))
    assert not grads.missing, f"no gradient for {grads.missing}"
    grad_err = grads.worst
    return {"loss_err": loss_err, "grad_err": grad_err, "sharded": sharded}
