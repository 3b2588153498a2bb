"""When a run saves its checkpoints, and what it says about them.

Every ``checkpoint.every`` steps and after the last (``save_final``) every rank saves: in the
step (:func:`~pp_core.checkpoint.save_checkpoint`), or with ``checkpoint.async: true`` staged to
host memory and written in the background (:class:`~pp_core.checkpoint.async_save.AsyncSaver`),
one save in flight at a time and the last one waited for before the run ends. Either way the
time a save kept the step from going on is measured: the summary reports it and, with
``checkpoint.async``, the metrics file too (a ``"event": "checkpoint"`` line per save, with the
wait for the previous background save).
A checkpoint counts as saved (for the restart account, :mod:`pp_core.app.restarts`) once it is
published, not when it is staged.
"""

from __future__ import annotations

import statistics
import time

from pp_core.app.rank.health import weights_finite
from pp_core.errors import PipelineError

__all__ = ["Checkpoints"]


class Checkpoints:
    """The run's saves, on every rank; ``recorder`` prints and writes metrics on the first."""

    def __init__(self, spec, ctx, recorder, attempts):
        self.spec, self.ctx, self.recorder, self.attempts = spec, ctx, recorder, attempts
        self.saver = None
        if spec.checkpoint.dir and spec.checkpoint.async_:
            from pp_core.checkpoint.async_save import AsyncSaver  # lazy: DCP, seconds

            self.saver = AsyncSaver()
        self.blocked: list[float] = []  # seconds each save held the step up (waits included)
        self.waited = 0.0
        self.end_waited = 0.0

    def due(self, step: int) -> bool:
        every, directory = self.spec.checkpoint.every, self.spec.checkpoint.dir
        last = step == self.spec.train.steps and self.spec.checkpoint.save_final
        return bool(directory) and bool((every and step % every == 0) or last)

    def after_step(self, step: int, pipe, optimizers) -> None:
        """Note a background save that finished; save if ``step`` is due."""
        if self.saver is not None and (finished := self.saver.poll()) is not None:
            self._saved(*finished)
        if not self.due(step):
            return
        directory = self.spec.checkpoint.dir
        if not weights_finite(pipe.model_parts, self.ctx.device):  # never over a good one
            raise PipelineError(f"step {step}: the weights hold NaN or inf values; the "
                                f"checkpoint was not saved, so {directory!r} keeps its last "
                                f"good one")
        from pp_core.app.check.resume import run_identity  # lazy: DCP, as below
        from pp_core.app.export.hf import export_record  # lazy: DCP, as below
        from pp_core.checkpoint import save_checkpoint  # lazy: as DCP's, the first save pays

        record = {"run": run_identity(self.spec), "export": export_record(self.spec)}
        began = time.perf_counter()
        if self.saver is None:
            path = save_checkpoint(directory, step, pipe.model_parts, optimizers, record=record)
            self._note(step, time.perf_counter() - began, 0.0)
            self._saved(step, path)
            return
        waited, blocked, finished = self.saver.save(directory, step, pipe.model_parts,
                                                    optimizers, record=record)
        if finished is not None:
            self._saved(*finished)
        self._note(step, waited + blocked, waited)
        wait = f" after waiting {waited:.2f} s for the previous save" if waited >= 0.01 else ""
        self.recorder.say(f"checkpoint of step {step} staged in {blocked * 1000:,.0f} ms{wait}; "
                          f"writing in the background")

    def _note(self, step: int, blocked: float, waited: float) -> None:
        self.blocked.append(blocked)
        self.waited += waited
        if self.recorder.metrics and self.saver is not None:
            self.recorder.metrics.write({"step": step, "event": "checkpoint",
                                         "blocked_s": round(blocked, 6),
                                         "waited_s": round(waited, 6)})

    def _saved(self, step: int, path, seconds: float | None = None) -> None:
        self.attempts.saved(step)
        background = "" if seconds is None else f" (written in the background in {seconds:.1f} s)"
        self.recorder.say(f"checkpoint saved: {path}{background}")

    def close(self) -> None:
        """The run's end: the save in flight is complete before anything else happens."""
        if self.saver is not None:
            waited, finished = self.saver.wait()
            self.saver.close()
            if finished is not None:
                self._saved(*finished)
            self.end_waited = waited  # after the last step: no step's hold

    def figures(self) -> dict | None:
        """For the summary: how many saves, how long one held the step (mean, longest)."""
        if not self.blocked:
            return None
        return {"saves": len(self.blocked), "async": self.saver is not None,
                "blocked_mean_s": statistics.fmean(self.blocked),
                "blocked_max_s": max(self.blocked), "waited_s": self.waited,
                "end_waited_s": self.end_waited}
