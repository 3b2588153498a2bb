"""What the ranks will read, checked as the ranks will read it: training *and* evaluation data.

- The dataset's vocabulary against the model's input embedding: a dataset that says its
  tokenizer's ``vocab_size``, and one that says its largest token id over the whole corpus
  (``max_token_id``: ``tokenized_text`` reads it off its cache's metadata), so an id past the
  embedding is refused before the step that would first meet it, not only when batch 0 holds it.
  A dataset that reads through a processor (``image_text``) says ``image_token_id``, its image
  placeholder, which must be the model's ``config.image_token_id``.
- ``distributed.sequence_parallel`` shards every sequence over the ``tp_size`` ranks: the
  training batch's and the evaluation batch's lengths must both divide by ``tp_size`` (an odd
  ``data.eval_args.seq_len`` aborted a rank inside gloo at the first evaluation).
- One convention for targets (docs/data.md, "Targets"): a dataset's target at position ``t`` is
  the token at ``t + 1``, and a loss takes it as it is. A loss that shifts labels itself
  (``shifts_labels = True``: Hugging Face's ``causal_lm_loss``) beside shifted targets would teach
  the token after next; ``cross_entropy`` beside targets equal to the inputs would teach a copy.
  :func:`check_labels` catches both on the first batch.
- :func:`meta_friendly`: the meta forward runs kernels whose meta form takes what the ranks'
  devices take (a float32 Mixtral's experts).
"""

from __future__ import annotations

import contextlib

__all__ = ["check_vocab", "check_sequence_shards", "check_labels", "label_problem",
           "meta_friendly"]


def _embedding_rows(model) -> int | None:
    from pp_core.app.check.fit import _input_embedding  # lazy: torch, with a model in hand

    embedding = _input_embedding(model) if model is not None else None
    return None if embedding is None else int(embedding.num_embeddings)


def check_vocab(data, model, key: str, problems: list[str]) -> None:
    """``data``'s ``vocab_size`` and ``max_token_id`` (when it says them) against the model's
    input embedding; ``key`` is ``data.args`` or ``data.eval_args``."""
    rows = _embedding_rows(model)
    if rows is None:
        return
    vocab = getattr(data, "vocab_size", None)
    source = "processor" if hasattr(data, "image_token_id") else "tokenizer"
    if isinstance(vocab, int) and not isinstance(vocab, bool) and rows < vocab:
        problems.append(f"{key}.{source}: the {source}'s vocabulary has {vocab} tokens but "
                        f"the model's embedding only {rows}; set the model's vocab_size "
                        f"(model.args) to at least {vocab}, or use "
                        + ("the processor the model was made with" if source == "processor"
                           else "a smaller tokenizer"))
        return
    token, wanted = getattr(data, "image_token_id", None), _image_token(model)
    if isinstance(token, int) and wanted is not None and token != wanted:
        problems.append(f"{key}.processor: the processor's image placeholder is token {token} "
                        f"but the model's image_token_id is {wanted}; use the processor saved "
                        f"with the model (or set the model's image_token_id)")
        return
    highest = getattr(data, "max_token_id", None)
    if isinstance(highest, int) and not isinstance(highest, bool) and highest >= rows:
        problems.append(f"{key}: the corpus holds token id {highest}, but the model's "
                        f"vocabulary has {rows} ids (0..{rows - 1}); a batch holding it would "
                        f"fail in the embedding; set model.args.vocab_size to at least "
                        f"{highest + 1}, or use the tokenizer the model was made for")


def _image_token(model) -> int | None:
    config = getattr(model, "config", None)
    found = getattr(config, "image_token_id", None)
    return found if isinstance(found, int) else getattr(config, "image_token_index", None)


def check_sequence_shards(spec, batch, key: str, problems: list[str]) -> None:
    """With sequence parallelism, the batch's sequence length must divide by ``tp_size``."""
    from pp_core.runtime.microbatch import first_tensor  # lazy: torch, with a batch in hand

    tp = spec.dims.seq_len_divisor
    if tp <= 1 or batch is None:
        return
    first = first_tensor(batch[0])
    if first is not None and first.dim() >= 2 and first.shape[1] % tp:
        problems.append(f"distributed.sequence_parallel: shards the sequence over the "
                        f"tp_size={tp} ranks, but the dataset yields sequences of {first.shape[1]} "
                        f"with {key}; "
                        f"make the length a multiple of {tp} ({key}.seq_len) or set "
                        f"sequence_parallel: false")


def check_labels(spec, batch, problems: list[str]) -> None:
    """The first batch's targets against the loss's convention (:func:`label_problem`)."""
    from pp_core.losses import resolve_loss  # lazy: with a batch in hand

    if batch is None:
        return
    named = spec.pipeline.loss_fn
    problem = label_problem(named if isinstance(named, str) else getattr(named, "__name__", "?"),
                            resolve_loss(named), spec.data.name, *batch)
    if problem is not None:
        problems.append(problem)


def label_problem(name: str, loss, data: str, inputs, target) -> str | None:
    """Why a token batch's targets do not fit the loss ``name`` (one line), or ``None``: checked
    for a loss that shifts its labels (``shifts_labels``) and for the built-in cross entropy, on
    integer ids and targets of one shape; a batch that reads both ways (one repeated token) is
    not judged."""
    import torch  # lazy: with a batch in hand

    from pp_core.losses import IGNORE_INDEX, cross_entropy

    shifts = bool(getattr(loss, "shifts_labels", False))
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if not (shifts or loss is cross_entropy) or not isinstance(ids, torch.Tensor) or \
            not isinstance(target, torch.Tensor) or ids.shape != target.shape or \
            ids.dim() < 2 or ids.shape[-1] < 2 or ids.is_floating_point() or \
            target.is_floating_point():
        return None
    valid = target != IGNORE_INDEX
    if not valid.any():
        return None
    copies = bool((target == ids)[valid].all())
    following = bool((target[..., :-1] == ids[..., 1:])[valid[..., :-1]].all())
    if copies == following:
        return None
    where = f"the targets of data {data!r}"
    if shifts and following:
        return (f"pipeline.loss_fn: {name} shifts its labels by one token, but {where} are "
                f"already the next tokens (target[t] = input[t + 1]): the model would learn the "
                f"token after next; use loss_fn: cross_entropy, which takes a dataset's targets "
                f"as they are (docs/data.md, 'Targets')")
    if not shifts and copies:
        return (f"pipeline.loss_fn: {name} takes targets that are the next tokens, but {where} "
                f"equal its inputs (Hugging Face labels): the model would learn to copy its "
                f"input; use loss_fn: pp_core_builtins.transformers:causal_lm_loss, which shifts "
                f"them, or make the dataset's targets the next tokens (docs/data.md, 'Targets')")
    return None


@contextlib.contextmanager
def meta_friendly(model):
    """Run ``model`` on the meta device with kernels whose meta form accepts what the ranks'
    devices accept: Hugging Face MoE experts default to ``grouped_mm``, whose meta kernel wants
    BF16 (a CUDA limit) while the CPU kernel takes float32, so a float32 Mixtral was refused with
    a message blaming ``data.args``. Within this block the experts run their ``eager`` loop
    (the same shapes); the model's own setting is restored afterwards."""
    changed = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) not in (None, "eager") and \
                all(config is not seen for seen, _ in changed):
            changed.append((config, config._experts_implementation))
    try:
        for config, _ in changed:
            config._experts_implementation = "eager"
        yield
    finally:
        for config, value in changed:
            config._experts_implementation = value
