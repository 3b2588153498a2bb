"""Tied input/output embeddings across stages: their gradients are summed after backward.

With ``tie_word_embeddings=True`` the unsplit model uses one tensor as ``model.embed_tokens.weight``
(first stage) and ``lm_head.weight`` (last stage), and its gradient is the sum of both uses. The
``hf_decoder`` splitter gives each holding stage its own copy (:mod:`.parts`) and records it in
``part.pp_tied_parameters`` / ``part.pp_tied_stages``; pp-core's core sums the copies' gradients
for every such weight, of any model (:mod:`pp_core.parallel.tied`, run by ``Pipeline.step``).
The names below are kept here for code written against this plugin.
"""

from __future__ import annotations

from pp_core.parallel.tied import TiedGroup, grad_baseline, sync_tied_gradients_of, tied_groups

__all__ = ["TiedGroup", "tied_groups", "grad_baseline", "sync_tied_gradients",
           "sync_tied_gradients_of"]


def sync_tied_gradients(pipe, baseline: dict | None = None) -> int:
    """:func:`sync_tied_gradients_of` for a :class:`pp_core.runtime.Pipeline`.

    ``Pipeline.step`` already does this; call it yourself only for gradients produced outside
    ``step``.
    """
    return sync_tied_gradients_of(pipe.model_parts, pipe.schedule.stage_ranks, pipe.rank,
                                  pipe.group, baseline)
