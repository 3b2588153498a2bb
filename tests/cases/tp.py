"""What the pp x tp tests run on every rank: a pipeline over ``mesh["pp"]`` whose parts are
sharded over ``mesh["tp"]`` with :func:`pp_core.parallel.apply_tensor_parallel`, compared with
the unsplit model on one process (loss and every gradient, ``full_tensor()``). Module-level
functions with picklable results: they run in DistPool workers.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from pp_core import PipelineConfig, build_pipeline
from pp_core.losses import resolve_loss
from tests.cases.compare import RELATIVE, grad_difference, reference_grads
from tests.cases.runtime import batch, reference

_MESH: dict = {}


def pp_tp_mesh(shape=(2, 2), names=("pp", "tp")):
    """The (pp, tp) mesh of the ranks (pp outermost, tp innermost; or ``shape`` named
    ``names``), made once per group."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (id(dist.group.WORLD), shape, names)
    if key not in _MESH:
        _MESH.clear()
        _MESH[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESH[key]


class CollectiveCounter:
    """Counts the functional collectives DTensor issues (``_c10d_functional`` ops: all_reduce,
    all_gather_into_tensor, reduce_scatter_tensor, ...) while active, forward and backward.
    (torch's ``CommDebugMode`` counts the same ops, but its module tracker does not follow a
    pipeline's interleaved microbatches.)"""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] not in \
                        ("wait_tensor", "_wrap_tensor_autograd"):
                    name = func.__name__.split(".")[0]
                    counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.counts = counts
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def tiny_gpt(layers: int = 4):
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=32, dim=16, num_layers=layers, num_heads=2, max_seq_len=16)


def dtensor_boundary_plan(sequence_parallel: bool) -> dict:
    """The built-in GPT plan, plus: every block returns a DTensor (sequence shards with
    sequence parallelism, else replicated) and takes a DTensor or a local tensor, so DTensors
    cross the stage boundaries."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    from pp_core_builtins.models.tp_plan import gpt_plan
    from pp_core_builtins.models.gpt import GPT

    between = Shard(1) if sequence_parallel else Replicate()
    plan = gpt_plan(GPT.__new__(GPT), sequence_parallel)
    plan["layers.*"] = PrepareModuleInputOutput(
        input_layouts=between, desired_input_layouts=between, use_local_input=True,
        output_layouts=between, desired_output_layouts=between, use_local_output=False)
    if not sequence_parallel:  # a plain LayerNorm takes the local (replicated) tensor
        plan["norm"] = PrepareModuleInput(input_layouts=between, desired_input_layouts=between,
                                          use_local_output=True)
    return plan


def tp_case(schedule: str, sequence_parallel: bool = False, pool: bool = False,
            boundary: str = "local", num_microbatches: int = 4, steps: int = 1,
            count: bool = False) -> dict:
    """``steps`` steps of pp2 x tp2 on the demo GPT; the last one vs one process.

    ``boundary``: ``local`` (the built-in plan: blocks return local tensors) or ``dtensor``
    (blocks return DTensors, which cross the stages as local shards plus placements).
    ``count``: count the collectives of the step with torch's ``CommDebugMode``.
    """
    from pp_core.parallel import apply_tensor_parallel

    mesh = pp_tp_mesh()
    model = tiny_gpt(4)
    ref_model = copy.deepcopy(model)
    local = 2 * num_microbatches
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local, pp_microbatch_size=2,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True,
                            pp_recv_buffer_pool=pool, pp_seq_len=8 if pool else None)
    pipe = build_pipeline(model, config, pp_group=mesh["pp"])
    plan = dtensor_boundary_plan(sequence_parallel) if boundary == "dtensor" else None
    modules = apply_tensor_parallel(pipe.model_parts, mesh["tp"], plan=plan,
                                    sequence_parallel=sequence_parallel)
    counts = None
    for step in range(steps):
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
        inputs, target = batch("gpt", local, seed=step + 1)
        if count:
            with CollectiveCounter() as counter:
                loss = pipe.step(inputs, target=target)
            counts = counter.counts
        else:
            loss = pipe.step(inputs, target=target)
        ref_loss = reference(ref_model, resolve_loss("cross_entropy"), inputs, target,
                             num_microbatches, scale=True)
    grads = grad_difference(pipe.model_parts, reference_grads(ref_model),
                            scale=lambda want: RELATIVE(want) + 1e-6)
    assert not grads.missing, f"no gradient for {grads.missing}"
    grad_err, names, placements = grads.worst, grads.names, grads.placements
    loss_err = None if loss is None else abs(float(loss) - ref_loss) / abs(ref_loss)
    from pp_core.parallel.gradients import clip_grad_norm

    norm = clip_grad_norm([p for part in pipe.model_parts for p in part.parameters()], None,
                          mesh["pp"].get_group())
    ref_norm = float(torch.cat([p.grad.flatten() for p in ref_model.parameters()]).norm())
    return {"loss_err": loss_err, "grad_err": grad_err, "names": names, "modules": modules,
            "norm_err": abs(norm - ref_norm) / ref_norm, "stages": pipe.stage_indices, "counts": counts, "placements": sorted(placements),
            "tp_rank": mesh["tp"].get_local_rank()}


def tp_matrix(schedule: str, variants: list) -> list:
    """Several :func:`tp_case` runs in one pool call: ``variants`` are keyword dicts."""
    return [tp_case(schedule, **variant) for variant in variants]


def expected_collectives(stages, num_layers: int, num_stages: int, microbatches: int,
                         sequence_parallel: bool) -> dict:
    """The collectives the built-in GPT plan implies on one rank for one step (ours: 4 blocks,
    evenly split). Per block and microbatch: two all-reduces forward (after ``proj`` and
    ``ffn.2``) and two backward (into ``qkv`` and ``ffn.0``); with sequence parallelism each
    becomes a reduce-scatter + all-gather pair. Embeddings: one forward all-reduce each
    (reduce-scatter with SP, plus an all-gather of the output gradient backward). Head: the
    logits' all-gather, and the input gradient's all-reduce (with SP: the input's all-gather and
    the gradient's reduce-scatter). With SP each replicated norm parameter's partial gradient is
    all-reduced once per step."""
    per_stage = num_layers // num_stages
    blocks = per_stage * len(stages)
    first, last = 0 in stages, (num_stages - 1) in stages
    m = microbatches
    if not sequence_parallel:
        counts = {"all_reduce": m * (4 * blocks + 2 * first + last),
                  "all_gather_into_tensor": m * last}
    else:
        counts = {"all_gather_into_tensor": m * (4 * blocks + 2 * first + 2 * last),
                  "reduce_scatter_tensor": m * (4 * blocks + 2 * first + last),
                  "all_reduce": 4 * blocks + 2 * last}
    return {k: v for k, v in counts.items() if v}



def hf_tp_case(schedule: str, arch: str, pool: bool = False, sequence_parallel: bool = False,
               embeds: bool = False, num_microbatches: int = 4) -> dict:
    """One step of pp2 x tp2 on a tiny Hugging Face decoder (``llama``, ``llama_tied``,
    ``qwen2``, ``mistral``: the ARCHITECTURES of test_transformers_models) vs one process;
    with ``sequence_parallel`` the activations between blocks and stages are sequence shards
    (the batch's 12 tokens, 6 per tp rank). ``embeds``: the first stage is given
    ``inputs_embeds`` (the model's own embeddings of the tokens) instead of ``input_ids``."""
    from pp_core.parallel import apply_tensor_parallel
    from pp_core_builtins.transformers import causal_lm_loss
    from tests.cases.hf import ARCHITECTURES, batch as hf_batch, reference_step
    from tests.cases.hf import tiny_model

    mesh = pp_tp_mesh()
    model_type, extra = ARCHITECTURES[arch]
    model = tiny_model(model_type, 4, **extra)
    ref_model = copy.deepcopy(model)
    local = 2 * num_microbatches
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local, pp_microbatch_size=2,
                            loss_fn=causal_lm_loss, scale_grads_in_schedule=True,
                            pp_recv_buffer_pool=pool, pp_seq_len=12 if pool else None)
    pipe = build_pipeline(model, config, pp_group=mesh["pp"])
    modules = apply_tensor_parallel(pipe.model_parts, mesh["tp"],
                                    sequence_parallel=sequence_parallel)
    inputs, target = hf_batch(local, seed=1)
    if embeds:
        with torch.no_grad():
            inputs["inputs_embeds"] = ref_model.model.embed_tokens(inputs.pop("input_ids"))
    loss = pipe.step(inputs, target=target)
    ref_loss, ref_grads = reference_step(ref_model, inputs, target, num_microbatches)
    ref_loss = float(ref_loss)
    grad_err, names, replicated = 0.0, [], []
    for part in pipe.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            grad = param.grad
            names.append(name)
            if grad is None:  # the embedding, given inputs_embeds
                assert name not in ref_grads, name
                continue
            if hasattr(grad, "full_tensor"):
                if all(p.is_replicate() for p in grad.placements):
                    replicated.append(name)  # a norm's, under sequence parallelism
                grad = grad.full_tensor()
            want = ref_grads[name] / num_microbatches
            grad_err = max(grad_err, ((grad - want).abs().max() / (want.abs().max() + 1e-6)).item())
    loss_err = None if loss is None else abs(float(loss) - ref_loss) / abs(ref_loss)
    return {"loss_err": loss_err, "grad_err": grad_err, "names": names, "modules": modules,
            "replicated": replicated, "tp_rank": mesh["tp"].get_local_rank()}


def hf_matrix(cases: list) -> list:
    return [hf_tp_case(*case) for case in cases]
