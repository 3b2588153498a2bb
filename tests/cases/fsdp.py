"""What the pp x dp tests run on every rank: a pipeline over ``mesh["pp"]`` whose parts the user
wrapped with torch's FSDP2 (``fully_shard``) or DDP over the mesh's dp dimension, one step per dp
rank on its half of the global batch, compared with the unsplit model on one process over the
whole global batch. Module-level functions, picklable results: they run in DistPool workers.
"""

from __future__ import annotations

import copy

import torch.distributed as dist

from pp_core import PipelineConfig, build_pipeline
from pp_core.losses import resolve_loss
from tests.cases.meshes import meshes
from tests.cases.runtime import batch, gpt, mlp, mse, reference


def pp_dp_meshes(hsdp: bool = False):
    """pp2 x dp_shard2 on 4 ranks, or pp2 x dp_replicate2 x dp_shard2 on 8 ranks (HSDP: the dp
    mesh is 2-D), pp outermost as ``pp-core run`` lays them out."""
    return meshes(pp=2, dp_replicate=2, dp_shard=2) if hsdp else meshes(pp=2, dp_shard=2)


def dp_rank_and_size(dp_mesh) -> tuple[int, int]:
    """This rank's index in the flattened dp mesh (replicate-major) and the dp degree."""
    rank = 0
    for dim in range(dp_mesh.ndim):
        rank = rank * dp_mesh.size(dim) + dp_mesh.get_local_rank(dim)
    return rank, dp_mesh.size()


class CollectiveCounter:
    """Counts FSDP2's all-gathers and reduce-scatters (``dist.*_single``) while active."""

    names = ("all_gather_single", "reduce_scatter_single")

    def __enter__(self):
        self.counts = dict.fromkeys(self.names, 0)
        self.saved = {name: getattr(dist, name) for name in self.names}
        for name, fn in self.saved.items():
            def counted(*args, _name=name, _fn=fn, **kwargs):
                self.counts[_name] += 1
                return _fn(*args, **kwargs)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def wrap_parts(pipe, engine: str, dp_mesh, reshard_after_forward: bool) -> int:
    """Wrap this rank's parts as a torchtitan user would; returns the FSDP units with params."""
    from torch.distributed.fsdp import fully_shard

    from pp_core.parallel import find_blocks

    units = 0
    for index, part in enumerate(pipe.model_parts):
        if engine in ("helper", "replicate"):
            from pp_core.parallel import apply_data_parallel

            return apply_data_parallel(pipe, dp_mesh, shard=engine == "helper",
                                       reshard_after_forward=reshard_after_forward)
        if engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            pipe.model_parts[index] = DistributedDataParallel(part,
                                                              process_group=dp_mesh.get_group())
            continue
        for _, block in find_blocks(part):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
            units += 1
        blocks = {id(p) for _, b in find_blocks(part) for p in b.parameters()}
        units += any(id(p) not in blocks for p in part.parameters())
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return units


def _model_and_data(kind: str):
    """The model (same weights on every rank), its loss, ``data(size, seed)`` and
    ``ref(model, inputs, target, n)``: loss and gradients of the unsplit model on one process
    for the mean of ``n`` microbatch losses."""
    if kind == "hf":  # a tiny Llama whose embedding is tied to lm_head, across stages
        from pp_core_builtins.transformers import causal_lm_loss
        from tests.cases.hf import batch as hf_batch, reference_step, tiny_model

        def ref(model, inputs, target, n):
            loss, grads = reference_step(model, inputs, target, n)
            return float(loss), {name: grad / n for name, grad in grads.items()}

        return (tiny_model("llama", 4, tie_word_embeddings=True), causal_lm_loss,
                lambda size, seed: hf_batch(size, seed=seed), ref)
    loss_name = mse if kind == "mlp" else "cross_entropy"
    if kind.startswith("lora"):  # the demo GPT with PEFT adapters (on blocks 4-7: "lora_late")
        from tests.cases.frozen import lora_gpt

        built = lora_gpt(8, layers_to_transform=(4, 5, 6, 7) if kind == "lora_late" else None)
        kind = "gpt"
    else:
        built = mlp(8) if kind == "mlp" else gpt(8)

    def ref(model, inputs, target, n):
        model.zero_grad(set_to_none=True)
        loss = reference(model, resolve_loss(loss_name), inputs, target, n, scale=True)
        return loss, {name: p.grad for name, p in model.named_parameters()}

    return built, loss_name, lambda size, seed: batch(kind, size, seed=seed), ref


def _rows(value, rows: slice):
    return {k: v[rows] for k, v in value.items()} if isinstance(value, dict) else value[rows]


def dp_case(schedule: str, engine: str = "fsdp", kind: str = "mlp", pool: bool = False,
            num_microbatches: int = 4, reshard_after_forward: bool = False,
            steps: int = 2, ac: str = "none", backend: str | None = None,
            hsdp: bool = False) -> dict:
    """``steps`` steps of pp2 x dp2; the last step's loss and full gradients vs one process.

    ``kind``: ``mlp``, ``gpt`` (the demo GPT) or ``hf`` (tiny tied Llama); ``ac`` / ``backend``:
    activation checkpointing / compile applied before the data parallelism, as the YAML does;
    ``hsdp``: 8 ranks, pp2 x dp_replicate2 x dp_shard2.
    """
    from pp_core.parallel import ParallelSettings, parallelize

    run_meshes = pp_dp_meshes(hsdp)
    dp_mesh = run_meshes.data_parallel_mesh()
    dp_rank, dp_size = dp_rank_and_size(dp_mesh)
    local = 2 * num_microbatches
    model, loss_name, data, ref_step = _model_and_data(kind)
    ref_model = copy.deepcopy(model)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local, pp_microbatch_size=2,
                            loss_fn=loss_name, scale_grads_in_schedule=True,
                            pp_recv_buffer_pool=pool, pp_seq_len=None if not pool else
                            (12 if kind == "hf" else 8),
                            patch_stage_backward_maybe_with_nosync=True)
    pipe = build_pipeline(model, config, meshes=run_meshes)
    helper = {"helper": "auto", "replicate": "replicate"}.get(engine, "none")
    done = parallelize(pipe, run_meshes, ParallelSettings(
        activation_checkpointing=ac, compile={"backend": backend} if backend else None,
        data_parallel=helper, reshard_after_forward=reshard_after_forward))
    units = done.data_parallel_units if helper != "none" else \
        wrap_parts(pipe, engine, dp_mesh, reshard_after_forward)
    for step in range(steps):
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        inputs, target = data(dp_size * local, step + 1)
        mine = slice(dp_rank * local, (dp_rank + 1) * local)
        with CollectiveCounter() as counter:
            loss = pipe.step(_rows(inputs, mine), target=target[mine])
        ref_loss, ref_grads = ref_step(ref_model, inputs, target, dp_size * num_microbatches)
    loss_err = None
    if loss is not None:
        for dim in range(dp_mesh.ndim):
            dist.all_reduce(loss, group=dp_mesh.get_group(dim))
        loss_err = abs(loss.item() / dp_size - ref_loss)
    grad_err, names = 0.0, []
    for part in pipe.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            name = name.removeprefix("module.")
            grad = param.grad
            if grad is None and not param.requires_grad:  # frozen: no gradient, here or there
                assert ref_grads.get(name) is None, name
                continue
            if hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            grad_err = max(grad_err, (grad - ref_grads[name]).abs().max().item())
            names.append(name)
    return {"loss_err": loss_err, "grad_err": grad_err, "names": names, "units": units,
            "counts": counter.counts}
