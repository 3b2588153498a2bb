"""The planner's memory model for sequence slices against the measured ``peak_saved_bytes``.

A slice is costed as ``1/K`` of a microbatch's saved activations (``ModelProfile.sliced``).
That holds because a slice's attention saves the per-slice keys and values its earlier slices
hold anyway (:mod:`pp_core.runtime.prefix_attention`), never their concatenation; before, the
concatenations made K = 4 measure 1.33x (gpipe) and 1.32x (interleaved) the planned peak here.
One process, the schedules that put every stage on it, the model profiled once.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pp_core import PipelineConfig, build_pipeline
from pp_core.losses import resolve_loss
from pp_core.measure.profile import profile_model
from pp_core.planning.candidate import Option
from pp_core.planning.choose import predict, schedule_defs
from pp_core_builtins.models.gpt import GPT


@pytest.fixture(scope="module")
def profiled():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, dim=32, num_layers=4, num_heads=2, max_seq_len=64)
    ids = torch.randint(0, 64, (4, 64))
    profile = profile_model(copy.deepcopy(model), ids[:1], ids[:1],
                            resolve_loss("cross_entropy"), [1], repeats=1)[1]
    return model, ids, profile


@pytest.mark.parametrize("schedule, stages_per_rank", [("gpipe", 1), ("interleaved_1f1b", 2)])
def test_planned_activations_with_slices_agree_with_the_measured_peak(profiled, schedule,
                                                                     stages_per_rank):
    model, ids, profile = profiled
    for k in (1, 4):
        candidate = predict(Option(schedule, stages_per_rank, 1, 4, k),
                            schedule_defs()[schedule], profile, 1)
        pipe = build_pipeline(copy.deepcopy(model), PipelineConfig(
            pp_schedule=schedule, pp_batch_size=4, pp_microbatch_size=1,
            loss_fn="cross_entropy", pp_seq_chunks=k,
            module_fqns_per_model_part=candidate.fqns_per_stage))
        pipe.step(ids, target=ids)
        planned = candidate.memory[0].activations
        assert abs(pipe.saved_bytes.peak / planned - 1) <= 0.03, (k, pipe.saved_bytes.peak,
                                                                  planned)
