"""The figures a run reports about its data (valid tokens, padding fraction, documents), and the
TensorBoard sink on ``pp_report_metrics`` (``output.tensorboard``)."""

import pytest
import torch

from pp_core.app.rank.data_metrics import TensorBoardSink, batch_figures


def test_batch_figures_count_like_the_loss():
    target = torch.tensor([[1, 2, -100, -100], [3, -100, -100, -100], [-100] * 4])
    figures = batch_figures(torch.zeros(3, 4, dtype=torch.long), target)
    assert figures == {"valid_tokens": 3, "padding_fraction": 0.75, "docs": 2}
    packed = {"input_ids": torch.zeros(2, 6, dtype=torch.long),
              "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])}
    target = torch.ones(2, 6, dtype=torch.long)
    target[0, [2, 4, 5]] = -100
    assert batch_figures(packed, target) == {"valid_tokens": 9, "padding_fraction": 0.25,
                                             "docs": 4}
    assert batch_figures(torch.randn(2, 3), torch.randn(2, 3)) == {}  # regression: no tokens


def test_tensorboard_sink_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(str(tmp_path))
    sink.pp_report_metrics(step=1, metrics={"loss": 2.5, "tokens_per_s": 10.0, "time": 1.0})
    sink.pp_report_metrics(step=2, metrics={"loss": 2.0, "tokens_per_s": 12.0, "lr": None})
    sink.pp_report_metrics(step=2, metrics={"eval_loss": 2.2})
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/eval_loss", "train/loss",
                                                "train/tokens_per_s"]
    assert [e.value for e in events.Scalars("train/loss")] == [2.5, 2.0]
