"""NeMo AutoModel-shaped models and the 2-rank cases of ``tests/nemo/test_nemo_pipeline.py``.

``NemoLM`` is laid out as NeMo's own (non-``transformers``) model classes are: a text module
``model`` with ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``, and an ``lm_head``;
its forwards skip the modules a stage does not hold (``embed_tokens is None``: the input is the
hidden states), as NeMo's do. Every case compares the pipeline's loss and every gradient with the
unsplit model run on one process over the same microbatches.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from pp_core import PipelineConfig, build_pipeline

VOCAB, DIM, SEQ = 64, 16, 8


class Rotary(nn.Module):
    """A rotary table (non-persistent buffer); ``trainable``: with a learned scale (a parameter
    every stage needs: NeMo's FQN lists name ``model.rotary_emb`` in every part)."""

    def __init__(self, trainable: bool = False):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, DIM, 2) / DIM),
                             persistent=False)
        self.scale = nn.Parameter(torch.tensor([0.7])) if trainable else None

    def forward(self, hidden, position_ids):
        if position_ids.dim() == 3:  # mRoPE: [3 (t/h/w), batch, seq]
            position_ids = position_ids.float().mean(0)
        angles = position_ids.float()[..., None] * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        if self.scale is not None:
            cos, sin = cos * self.scale, sin * self.scale
        return torch.cat([cos, sin], -1).to(hidden.dtype)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, hidden, rope):
        return hidden + torch.tanh(self.proj(hidden * rope + hidden))


class TextModel(nn.Module):
    def __init__(self, num_layers: int, trainable_rope: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(num_layers))
        self.norm = nn.LayerNorm(DIM)
        self.rotary_emb = Rotary(trainable_rope)

    def forward(self, input_ids, position_ids=None):
        hidden = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1])[None].expand(hidden.shape[0], -1)
        rope = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, rope)
        return self.norm(hidden) if self.norm is not None else hidden


class NemoLM(nn.Module):
    """Not a ``transformers.PreTrainedModel``: laid out like one."""

    def __init__(self, num_layers: int = 4, trainable_rope: bool = False, text: str = "model"):
        super().__init__()
        setattr(self, text, TextModel(num_layers, trainable_rope))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, position_ids=None):
        hidden = self.model(input_ids, position_ids=position_ids)
        return self.lm_head(hidden) if self.lm_head is not None else hidden


def _rope(hidden, position_ids):
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1])[None]
    if position_ids.dim() == 3:  # mRoPE: [3 (t/h/w), batch, seq]
        position_ids = position_ids.float().mean(0)
    angles = position_ids.float()[..., None] / 100 ** (torch.arange(0, DIM, 2) / DIM)
    return torch.cat([angles.cos(), angles.sin()], -1).to(hidden.dtype)


class FlatLayer(Layer):
    def forward(self, hidden, position_ids=None):
        return super().forward(hidden, _rope(hidden, position_ids))


class FlatLM(nn.Module):
    """Blocks on the root (pp-core's ``layers`` splitter), position ids as a keyword input of
    every stage."""

    def __init__(self, num_layers: int = 4):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(FlatLayer() for _ in range(num_layers))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, position_ids=None):
        hidden = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        for layer in self.layers:
            hidden = layer(hidden, position_ids)
        if self.norm is not None:
            hidden = self.norm(hidden)
        return self.lm_head(hidden) if self.lm_head is not None else hidden


class MropeLM(FlatLM):
    """Declares, as NeMo's Qwen3.5-MoE does, that mRoPE position ids ``[3, batch, seq]`` are
    split into microbatches along dim 1."""

    def get_pipeline_kwargs_chunk_dims(self, kwargs):
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
            return {"position_ids": 1}
        return {}


class SharedLinearNet(nn.Module):
    """One ``nn.Linear`` object used as ``layers.0`` and ``layers.2`` (issue 25, item 4)."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([shared, nn.Linear(DIM, DIM), shared, nn.Linear(DIM, DIM)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x) if self.head is not None else x


def lm_loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1))


def mse(output, target):
    return nn.functional.mse_loss(output.float(), target)


def _reference(model, loss_fn, inputs, target, m, stage_kwargs=None, dims=None):
    """Mean microbatch loss of the unsplit model, gradients of the sum accumulated."""
    size = target.shape[0] // m
    total = 0.0
    for k in range(m):
        def cut(value, dim=0):
            return value.narrow(dim, k * size, size)
        kwargs = {key: cut(v, (dims or {}).get(key, 0)) for key, v in (stage_kwargs or {}).items()}
        loss = loss_fn(model(cut(inputs), **kwargs), cut(target))
        loss.backward()
        total += loss.item()
    return total / m


def _compare(pipe, ref, loss, want, *, same_dtype=True) -> dict:
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    err, names = 0.0, []
    for part in pipe.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            names.append(name)
            if same_dtype:
                assert param.dtype == ref_params[name].dtype, (name, param.dtype)
            expected = ref_params[name].grad
            err = max(err, (param.grad.float() - expected.float()).abs().max().item())
    return {"loss_err": None if loss is None else abs(float(loss) - want), "grad_err": err,
            "names": sorted(set(names)), "stages": pipe.stage_indices}


def lm_case(kind: str, schedule: str = "1f1b", m: int = 2, seqs=(SEQ,), seq_len=None,
            fqns=None, layers_per_stage=None, trainable_rope=False, pool=False):
    """A NeMo-shaped LM on 2 ranks, one step per entry of ``seqs`` (its sequence length)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = {"mrope": MropeLM, "flat": FlatLM}[kind]() if kind != "lm" else \
        NemoLM(trainable_rope=trainable_rope)
    ref = copy.deepcopy(model)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=2 * m, pp_microbatch_size=2,
                            loss_fn=lm_loss, pp_seq_len=seq_len, module_fqns_per_model_part=fqns,
                            layers_per_stage=layers_per_stage, pp_recv_buffer_pool=pool)
    records: list = []
    handler = _Records(records)
    logging.getLogger("pp_core").addHandler(handler)
    try:
        pipe = build_pipeline(model, config)
        steps = []
        for step, seq in enumerate(seqs):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, VOCAB, (2 * m, seq), generator=g)
            target = torch.randint(0, VOCAB, (2 * m, seq), generator=g)
            stage_kwargs, dims = None, None
            if kind == "mrope":  # [3, batch, seq]: batch on dim 1
                pos = torch.stack([torch.arange(seq) * (i + 1) for i in range(3)])
                stage_kwargs = {"position_ids": pos[:, None].expand(3, 2 * m, seq).clone()}
                stage_kwargs["position_ids"][:, ::2] += 1  # samples differ along the batch
                dims = {"position_ids": 1}
            for module in pipe.model_parts + [ref]:
                module.zero_grad(set_to_none=True)
            loss = pipe.step(ids, target=target, stage_kwargs=stage_kwargs)
            want = _reference(ref, lm_loss, ids, target, m, stage_kwargs, dims)
            steps.append(_compare(pipe, ref, loss, want))
    finally:
        logging.getLogger("pp_core").removeHandler(handler)
    return {"rank": dist.get_rank(), "steps": steps, "notes": records,
            "splitter": pipe.plan.split.splitter}


class _Records(logging.Handler):
    def __init__(self, records):
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record):
        self.records.append(record.getMessage())


def shared_linear_case(schedule: str = "1f1b", m: int = 2):
    """One nn.Linear at layers.0 (rank 0) and layers.2 (rank 1): gradient summed over both."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    import torch.distributed as dist

    model = SharedLinearNet()
    ref = copy.deepcopy(model)
    if dist.get_rank() == 1:  # built differently here: the lowest stage's copy wins at build
        with torch.no_grad():
            model.layers[0].weight.add_(1.0)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=2 * m, pp_microbatch_size=2,
                            loss_fn=mse)
    pipe = build_pipeline(model, config)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * m, DIM, generator=g), torch.randn(2 * m, 1, generator=g)
    loss = pipe.step(x, target=y)
    want = _reference(ref, mse, x, y, m)
    result = _compare(pipe, ref, loss, want)
    # an optimizer step on each rank keeps the two copies identical
    for part in pipe.model_parts:
        torch.optim.SGD(part.parameters(), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    result["weights"] = {name: p.detach().clone() for part in pipe.model_parts
                         for name, p in part.named_parameters(remove_duplicate=False)}
    return result


def dtype_case():
    """dtype=bfloat16: fp32 parameters stay fp32, the tensors between stages are bf16."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = FlatLM()
    seen = []

    def record(module, args):  # what a later stage receives
        if not torch.is_tensor(args[0]) or args[0].is_floating_point():
            seen.append(args[0].dtype)

    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=4, pp_microbatch_size=2,
                            loss_fn=lm_loss, dtype=torch.bfloat16)
    pipe = build_pipeline(model, config)
    for part in pipe.model_parts:
        part.register_forward_pre_hook(record)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # compute precision: the model's own
        pipe.step(ids, target=torch.randint(0, VOCAB, (4, SEQ), generator=g))
    return {"param_dtypes": sorted({str(p.dtype) for part in pipe.model_parts
                                    for p in part.parameters()}),
            "grad_dtypes": sorted({str(p.grad.dtype) for part in pipe.model_parts
                                   for p in part.parameters()}),
            "received": sorted({str(d) for d in seen}), "stages": pipe.stage_indices}


class NemoRope:
    """A runtime initializer written to NeMo's keyword-only protocol."""

    def __init__(self, dim: int):
        self.resource_key = ("rope-cache",)
        self.signature = ("rope", dim)
        self.calls: list = []

    def prepare(self, *, num_tokens, device):
        self.calls.append((num_tokens, str(device)))


ROPE = NemoRope(DIM)


class RopeLayer(Layer):
    """A layer that asks for its rotary cache the NeMo way."""

    def get_pipeline_runtime_initializers(self):
        return [ROPE]


def rope_lm(num_layers: int = 2) -> NemoLM:
    """``model.target`` of the validate test: a NeMo-shaped LM whose layers share one cache."""
    model = NemoLM(num_layers)
    model.model.layers = nn.ModuleList(RopeLayer() for _ in range(num_layers))
    return model
