"""``peak_saved_bytes`` (:class:`pp_core.runtime.saved_bytes.SavedBytes`): a storage saved by
several autograd nodes, or as several views, counts once; parameters do not count; bytes come
back when the graph that saved them is freed."""

from __future__ import annotations

import torch

from pp_core.runtime.saved_bytes import SavedBytes


def test_a_storage_saved_several_times_counts_once_and_parameters_not_at_all():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedBytes()
    with meter.measuring([weight]):
        h = x @ weight  # saves x and weight (a parameter: not counted)
        a, b = h[:, :4], h[:, 4:]  # two views of h's storage
        out = (a * b).sum() + (a.sin()).sum()  # mul saves both views, sin saves a: one storage
        peak = meter.peak
        assert peak == x.untyped_storage().nbytes() + h.untyped_storage().nbytes()
        out.backward()
        del out, a, b, h
        assert meter._live == 0  # the graph is freed: nothing held
    assert meter.peak == peak
