"""Whether the data fits the model and the model fits this machine, read off the meta model.

Checked for the training batch and, when ``train.eval_every`` is set, the evaluation batch
(docs promise an eval ``seq_len`` beyond the model's is caught): input token ids below the
input embedding's rows, sequence lengths within the model's ``max_seq_len`` attribute. And every rank builds the whole model before cutting out its
stages, so the ranks on one machine need that many copies of its parameters in memory. And
``distributed.mixed_precision`` lowers float32 parameters for compute: a model built in a 16-bit
dtype already has nothing for it to lower.
"""

from __future__ import annotations

import os

from pp_core.errors import quoted

__all__ = ["check_fit", "check_memory", "check_mixed_precision", "machine_memory"]


def _input_embedding(model):
    import torch  # lazy: torch only with a model in hand

    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            found = get()
            if isinstance(found, torch.nn.Embedding):
                return found
        except Exception:  # noqa: BLE001 - a model without one (HF raises NotImplementedError)
            pass
    return next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)


def _max_seq_len(model) -> int | None:
    # (a Hugging Face config's max_position_embeddings is no hard limit: rotary models run longer)
    value = getattr(model, "max_seq_len", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def check_fit(model, batch, key: str, problems: list[str]) -> None:
    """Token ids and sequence length of ``batch`` (from ``key``, ``data.args`` or
    ``data.eval_args``) against the model's input embedding and ``max_seq_len``."""
    import torch  # lazy: see _input_embedding

    from pp_core.runtime.microbatch import first_tensor  # lazy: torch, with a batch in hand

    inputs = first_tensor(batch[0])
    if model is None or inputs is None or inputs.is_floating_point() or inputs.numel() == 0:
        return
    embedding = _input_embedding(model)
    if embedding is not None:
        rows = embedding.num_embeddings
        for what, tensor in (("input", inputs),):  # targets may be another vocabulary
            if not isinstance(tensor, torch.Tensor) or tensor.is_floating_point() or \
                    tensor.numel() == 0 or tensor.device.type == "meta":
                continue
            highest = int(tensor.max())
            if highest >= rows:
                problems.append(f"{key}: the data holds {what} token id {highest}, but the model's "
                                f"vocabulary has {rows} ids (0..{rows - 1}); make the data's "
                                f"vocabulary and model.args agree (e.g. vocab_size)")
                return
    limit = _max_seq_len(model)
    if limit is not None and inputs.dim() >= 2 and inputs.shape[1] > limit:
        problems.append(f"{key}: the data's sequence length {inputs.shape[1]} is more than the "
                        f"model's max_seq_len {limit}; shorten {key}.seq_len or raise "
                        f"model.args.max_seq_len")


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or ``None`` where it cannot be read."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(spec, model, problems: list[str]) -> None:
    """Refuse a model whose whole parameters, once per local rank, exceed this machine's memory."""
    if model is None:
        return
    total = machine_memory()
    if not total:
        return
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    local = max(1, spec.world_size // spec.distributed.max_nodes)
    if size * local > total:
        key = "model.target" if spec.model.target else "model.args"
        problems.append(f"{key}: the model's parameters take {size / 2**30:,.1f} GiB, and each of "
                        f"the {local} rank(s) on this machine builds the whole model before "
                        f"taking its stages: {local} x {size / 2**30:,.1f} GiB is more than this "
                        f"machine's {total / 2**30:,.1f} GiB of memory; use a smaller model "
                        f"({quoted(str(spec.model.args), 80)}) or more machines")


def check_mixed_precision(spec, model, problems: list[str]) -> None:
    """``distributed.mixed_precision`` needs float32 parameters: FSDP2 keeps them and computes in
    ``param_dtype``; parameters built or cast to 16 bits would be cast again, or kept as they are
    with the policy doing nothing."""
    if model is None or not spec.distributed.mixed_precision:
        return
    dtypes = {spec.model.dtype} if spec.model.dtype else \
        {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    found = sorted(dtypes - {"float32"})
    if found:
        where = "model.dtype" if spec.model.dtype else \
            ("model.target" if spec.model.target else "model.args")
        problems.append(f"distributed.mixed_precision: casts float32 parameters to a lower "
                        f"precision for compute, but the model's parameters are "
                        f"{', '.join(found)} ({where}); keep one of them: drop mixed_precision, "
                        f"or build the model in float32")
