"""Every rank of a pipeline must build the same pipeline: check it before the first step.

Under torchrun every node reads its own pipeline file and model code. Ranks built with different
microbatch sizes once ran a first step with wrong gradients and then timed out; different batch
sizes trained 3 steps on wrong losses. :func:`check_ranks_agree` compares a digest of each
*field* of what a rank built (every ``PipelineConfig`` field, the model's parameter names and
shapes, the schedule's actions, the split) across the ranks of the pipeline's process group -
one ``all_gather`` of 8-byte hashes, and a second one of the differing values' text only when
they differ - and raises the same :class:`~pp_core.ConfigError` on every rank, naming each field
that differs and which rank has which value. Every rank decides from the same gathered data, so
every rank refuses.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping

import torch
import torch.distributed as dist

from pp_core.errors import ConfigError

__all__ = ["check_ranks_agree", "config_fields", "model_fields", "plan_fields"]

_SHOWN = 120  # characters of a value quoted in the message
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def describe(value: Any) -> str:
    """A text that is equal on two processes iff the values are (functions by their name)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}:{value.__qualname__}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + "}"
    return _ADDRESS.sub("", repr(value))  # "<Loss object at 0x7f...>": the address differs


def config_fields(config) -> dict[str, str]:
    """``PipelineConfig`` fields, by name; a CSV schedule by its contents, not its path (each
    node may keep its copy elsewhere)."""
    fields = {name: describe(value) for name, value in config.to_dict().items()}
    if config.pp_schedule_csv is not None:
        try:
            with open(config.pp_schedule_csv, "rb") as handle:
                data = handle.read()
            fields["pp_schedule_csv"] = f"a CSV, sha256 {hashlib.sha256(data).hexdigest()[:16]}"
        except OSError as exc:
            fields["pp_schedule_csv"] = f"an unreadable CSV ({type(exc).__name__})"
    return fields


def model_fields(model: torch.nn.Module) -> dict[str, str]:
    """The model's parameter and buffer names, shapes and dtypes, as one digest and a count;
    and which parameters are frozen (the program drops frozen stages' backward work: ranks that
    froze differently would wait for gradients that are never sent)."""
    digest, frozen = hashlib.sha256(), hashlib.sha256()
    count = elements = num_frozen = 0
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, tensor in items:
            digest.update(f"{kind} {name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
            count += 1
            elements += tensor.numel()
            if kind == "p" and not tensor.requires_grad:
                frozen.update(f"{name}\n".encode())
                num_frozen += 1
    return {"model parameters and buffers":
            f"{count} tensors, {elements:,} elements (sha256 {digest.hexdigest()[:12]})",
            "frozen parameters (requires_grad=False)":
            f"{num_frozen} (sha256 {frozen.hexdigest()[:12]})"}


def plan_fields(schedule, plan, failure: BaseException | None = None) -> dict[str, str]:
    """The schedule (placement, every rank's actions) and the split (FQNs per stage);
    when planning raised, that it failed (the same on every rank that failed alike)."""
    if failure is not None:
        text = f"failed ({type(failure).__name__})"
        return {"schedule": text, "split (module FQNs per stage)": text}
    actions = hashlib.sha256("\n".join(schedule.rows()).encode()).hexdigest()[:12]
    # not the name: a CSV schedule is named after its file, which each node may name alike
    return {"schedule": f"stages on ranks {schedule.stage_ranks}, actions sha256 {actions}",
            "split (module FQNs per stage)": describe(plan.fqns_per_stage)}


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check_ranks_agree(group, fields: Mapping[str, str], device, what: str) -> None:
    """Raise the same ``ConfigError`` on every rank of ``group`` when ``fields`` differ.

    ``fields`` must have the same names on every rank (values are free). ``what`` says what was
    compared, for the message. A collective: every rank of ``group`` must call it.
    """
    names = sorted(fields)
    size = dist.get_world_size(group)
    device = torch.device(device)
    mine = torch.tensor([_hash(fields[name]) for name in names], dtype=torch.int64,
                        device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    hashes = torch.stack(gathered).cpu()
    differ = [i for i in range(len(names)) if bool((hashes[:, i] != hashes[0, i]).any())]
    if not differ:
        return
    # every rank saw the same hashes, so every rank takes part in this second round
    width = _SHOWN * 4 + 8  # utf-8: up to 4 bytes a character, and room for the ellipsis
    text = torch.zeros(len(differ), width, dtype=torch.uint8)
    for row, i in enumerate(differ):
        value = fields[names[i]]
        value = value if len(value) <= _SHOWN else value[:_SHOWN] + " ..."
        encoded = value.encode()[:width]
        text[row, :len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    text = text.to(device)
    texts = [torch.empty_like(text) for _ in range(size)]
    dist.all_gather(texts, text, group=group)
    texts = [t.cpu() for t in texts]
    problems = []
    for row, i in enumerate(differ):
        by_value: dict[str, list[int]] = {}
        for rank in range(size):
            raw = bytes(texts[rank][row].tolist()).rstrip(b"\0")
            by_value.setdefault(raw.decode(errors="replace"), []).append(rank)
        shown = "; ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} "
                          f"{', '.join(map(str, ranks))}: {value}"
                          for value, ranks in by_value.items())
        problems.append(f"{names[i]} differs ({shown})")
    raise ConfigError(f"the ranks of this pipeline built different {what}: "
                      + "; ".join(problems) + ". Every rank must build the same pipeline: give "
                      "every node the same pipeline file and model code (under torchrun each "
                      "node reads its own)")
