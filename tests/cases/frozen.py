"""What the frozen-parameter and LoRA tests run on every rank (inside :class:`DistPool` workers).

Each case builds a pipeline of a partly frozen model (``requires_grad_(False)`` on some layers,
or PEFT LoRA adapters on the tiny GPT), takes optimizer steps next to the unsplit model on this
process, and returns plain values: loss and gradient differences, which parameters got a
gradient, which compute actions ran, and which gradient messages were sent and received (the
tags of the P2P calls: a gradient message's tag names the stage whose outputs it belongs to).
"""

from __future__ import annotations

import copy
import re

import torch

from tests.cases.runtime import batch, compare, gpt, mlp, mse, reference
from pp_core import PipelineConfig, build_pipeline
from pp_core.losses import resolve_loss
from pp_core.runtime.observers import ActionObserver
from pp_core.runtime.wire import TAG_BACKWARD
from pp_core.schedule.frozen import backward_from

_FIRST_BACKWARD_TAG = 64  # pp_core.runtime.transfers: gloo gives each gradient message a tag


class _Recorder(ActionObserver):
    def __init__(self):
        self.actions = []

    def on_action_start(self, action) -> None:
        self.actions.append(str(action))


def _count_gradient_messages(pipe, num_microbatches: int, log: dict) -> None:
    """Record the stage each gradient message sent or received belongs to (by its tag)."""
    p2p = pipe.p2p

    def stage_of(tag):
        if tag == TAG_BACKWARD:
            return -1
        if tag >= _FIRST_BACKWARD_TAG:
            return (tag - _FIRST_BACKWARD_TAG) // num_microbatches
        return None

    for name in ("isend", "irecv"):
        original = getattr(p2p, name)

        def wrapped(tensor, peer, tag, original=original, name=name):
            stage = stage_of(tag)
            if stage is not None:
                log[name].append(stage)
            return original(tensor, peer, tag)
        setattr(p2p, name, wrapped)


def freeze_layers(model, layers) -> None:
    """``requires_grad_(False)`` on the parameters of the MLP's layers ``layers``."""
    for name, param in model.named_parameters():
        if int(name.split(".")[0]) in layers:
            param.requires_grad_(False)


def lora_gpt(layers: int = 4, target_modules=None, layers_to_transform=None):
    """The tiny GPT with LoRA adapters as ``model.lora`` builds them (random B, so every adapter
    gradient is non-zero): the module PEFT changed in place, with the model's own FQNs."""
    from pp_core.app.adapters import apply_adapters

    settings = {"r": 4, "alpha": 8, "init_lora_weights": False}
    if target_modules is not None:
        settings["target_modules"] = list(target_modules)
    if layers_to_transform is not None:
        settings["layers_to_transform"] = list(layers_to_transform)  # layers_pattern: found
    model = gpt(layers)
    torch.manual_seed(1)
    return apply_adapters(model, settings, None)


def frozen_case(schedule, num_microbatches, kind="mlp", frozen=(), buffer_pool=False, steps=2,
                layers_to_transform=None) -> dict:
    """``steps`` SGD steps of ``schedule`` on a partly frozen model next to the unsplit one.

    ``kind``: ``mlp`` (``frozen``: its layers to freeze) or ``lora`` (the tiny GPT with adapters).
    """
    if kind == "mlp":
        model = mlp(8)
        freeze_layers(model, set(frozen))
    else:
        model = lora_gpt(4, layers_to_transform=layers_to_transform)
    ref_model = copy.deepcopy(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    loss_name = "cross_entropy" if kind == "lora" else None
    loss_fn = resolve_loss(loss_name) if loss_name else mse
    batch_size = 2 * num_microbatches
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=batch_size, pp_microbatch_size=2,
                            loss_fn=loss_name or mse, pp_recv_buffer_pool=buffer_pool)
    pipe = build_pipeline(model, config)
    recorder, log = _Recorder(), {"isend": [], "irecv": []}
    pipe.add_action_observer(recorder)
    _count_gradient_messages(pipe, num_microbatches, log)
    params = [p for part in pipe.model_parts for p in part.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1) if params else None
    ref_params = [p for p in ref_model.parameters() if p.requires_grad]
    ref_optimizer = torch.optim.SGD(ref_params, lr=0.1) if ref_params else None
    data = "gpt" if kind == "lora" else "mlp"
    worst = {"grad_err": 0.0, "loss_err": 0.0}
    for step in range(steps):
        inputs, target = batch(data, batch_size, seed=step + 1)
        loss = pipe.step(inputs, target=target)
        if ref_optimizer is None:  # nothing to train: the losses alone
            with torch.no_grad():
                ref_loss = sum(loss_fn(ref_model(x), y).item() for x, y in zip(
                    inputs.split(2), target.split(2))) / num_microbatches
        else:
            ref_loss = reference(ref_model, loss_fn, inputs, target, num_microbatches, False)
        result = compare(pipe, ref_model, loss, ref_loss)
        worst["grad_err"] = max(worst["grad_err"], result["grad_err"])
        if result["loss_err"] is not None:
            worst["loss_err"] = max(worst["loss_err"], result["loss_err"])
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        if ref_optimizer is not None:
            ref_optimizer.step()
            ref_optimizer.zero_grad()
    ref_params = dict(ref_model.named_parameters())
    changed, drift, grads_on_frozen, trained = [], 0.0, [], []
    for part in pipe.model_parts:
        for name, param in part.named_parameters():
            if name in base:
                if not torch.equal(param.detach(), base[name]):
                    changed.append(name)
                if param.grad is not None:
                    grads_on_frozen.append(name)
            else:
                trained.append(name)
                drift = max(drift, (param.detach() - ref_params[name].detach()).abs().max().item())
    return {**result, "grad_err": worst["grad_err"],
            "loss_err": worst["loss_err"] if result["loss_err"] is not None else None,
            "changed": changed, "drift": drift, "grads_on_frozen": grads_on_frozen,
            "trained": trained, "actions": recorder.actions, "sent": log["isend"],
            "received": log["irecv"], "trainable": pipe.plan.trainable,
            "num_stages": pipe.num_stages}


def freeze_on_rank_1() -> tuple[str, str]:
    """Rank 1 freezes layer 0, rank 0 does not: build_pipeline must refuse on both ranks."""
    import torch.distributed as dist

    model = mlp(8)
    if dist.get_rank() == 1:
        freeze_layers(model, {0, 1, 2, 3})
    try:
        build_pipeline(model, PipelineConfig(pp_batch_size=4, pp_microbatch_size=2, loss_fn=mse))
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return type(exc).__name__, str(exc)
    return "no error", ""


# ------------------------------------------------ checks, in the test process

def parse(text: str) -> tuple[int, str, int]:
    stage, kind, microbatch = re.fullmatch(r"(\d+)([A-Z_]+)(\d+)", text).groups()
    return int(stage), kind, int(microbatch)


def check_frozen(results: list, atol: float = 1e-6) -> None:
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 1 and losses[0] <= 10 * atol, f"loss differs: {losses}"
    trainable = results[0]["trainable"]
    start = backward_from(trainable)
    for rank, result in enumerate(results):
        assert not result["missing"], f"rank {rank}: no gradient for {result['missing']}"
        assert result["grad_err"] <= atol, f"rank {rank}: gradient differs by {result['grad_err']}"
        assert not result["changed"], f"rank {rank}: frozen parameters changed: {result['changed']}"
        assert not result["grads_on_frozen"], f"rank {rank}: {result['grads_on_frozen']} got .grad"
        assert result["drift"] <= 1e-5, f"rank {rank}: trained parameters drift {result['drift']}"
        for stage, kind, _ in map(parse, result["actions"]):
            if kind in ("B", "I", "W"):
                assert stage >= start, f"rank {rank} ran {stage}{kind} in the frozen prefix"
                assert kind != "W" or trainable[stage], f"rank {rank} ran {stage}W: no weights"
                assert kind != "I" or trainable[stage], f"rank {rank} split {stage}'s backward"
            if kind in ("SEND_B", "RECV_B"):
                assert stage >= start, f"rank {rank} ran {stage}{kind} for the frozen prefix"
        for stage in result["sent"] + result["received"]:
            assert stage >= start, f"rank {rank}: a gradient message for frozen stage {stage}"
