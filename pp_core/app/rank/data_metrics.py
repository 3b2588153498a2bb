"""What a step's batch holds, counted the way the loss counts it; and the TensorBoard sink.

:func:`batch_figures` reads the global batch a step trains on: the valid target tokens (entries
``!= -100`` of the target, the tokens the built-in losses count), the padding fraction (the
share of target entries that are not valid) and the documents (rows whose position ids restart
count one document per restart - packed rows, ``tokenized_text`` - else one per row with a valid
target). Integer targets only; a regression target gives ``{}``.

:class:`TensorBoardSink` is a ``pp_report_metrics`` implementation that the run registers with
its plugin manager on the first rank when ``output.tensorboard`` names a directory: every logged
figure becomes a scalar (``train/loss``, ``train/tokens_per_s``, ``eval/eval_loss``, ...) in
TensorBoard's own ``SummaryWriter``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pp_core.errors import ConfigError, install_extra
from pp_core.hookspecs import hookimpl
from pp_core.runtime.microbatch import first_tensor
from pp_core.write_failures import disk_error, write_failure

__all__ = ["batch_figures", "TensorBoardSink"]


def batch_figures(inputs, target) -> dict[str, Any]:
    """``{"valid_tokens", "padding_fraction", "docs"}`` of one global batch (see the module)."""
    labels = first_tensor(target)
    if labels is None or labels.is_floating_point() or labels.numel() == 0:
        return {}
    valid = labels != -100
    count = int(valid.sum())
    positions = inputs.get("position_ids") if isinstance(inputs, dict) else None
    if isinstance(positions, torch.Tensor) and positions.dim() == 2:
        docs = positions.shape[0] + int((torch.diff(positions, dim=-1) != 1).sum())
    else:
        docs = int(valid.reshape(valid.shape[0], -1).any(-1).sum()) if valid.dim() else 1
    return {"valid_tokens": count, "padding_fraction": round(1.0 - count / labels.numel(), 6),
            "docs": docs}


def _quiet_writer_thread() -> None:
    """TensorBoard's writer thread re-raises a failed write (its traceback printed by
    ``threading.excepthook``) and the next flush raises it again: leave the telling to the sink."""
    import threading  # lazy: only with output.tensorboard

    previous = threading.excepthook
    if getattr(previous, "pp_core_tensorboard", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and disk_error(args.exc_value):
            return
        previous(args)
    hook.pp_core_tensorboard = True
    threading.excepthook = hook


class TensorBoardSink:
    """Writes every logged figure to ``directory`` as TensorBoard scalars."""

    def __init__(self, directory: str):
        try:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard, optional
        except ImportError:
            raise ConfigError(
                f"output.tensorboard={directory!r} needs the tensorboard package: "
                f"{install_extra('tensorboard')} (or pip install tensorboard), or remove "
                f"output.tensorboard") from None
        self.directory, self.writer = directory, None
        _quiet_writer_thread()
        self._guarded(lambda: setattr(self, "writer", SummaryWriter(log_dir=directory)))

    def _guarded(self, call) -> None:
        """``call()``; a full or read-only disk ends TensorBoard (one warning), not the run."""
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is the disk
            if disk_error(exc) is None:
                raise
            self.writer = None
            logging.getLogger(__name__).warning("%s", write_failure(
                "output.tensorboard", self.directory, disk_error(exc),
                "TensorBoard gets no more figures this run; training goes on"))

    @hookimpl
    def pp_report_metrics(self, step, metrics):
        if self.writer is None:
            return
        section = "eval" if any(key.startswith("eval") for key in metrics) else "train"

        def write():
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and key != "time":
                    self.writer.add_scalar(f"{section}/{key}", value, step)
            self.writer.flush()
        self._guarded(write)

    def close(self) -> None:
        if self.writer is not None:
            self._guarded(self.writer.close)
