"""Every rank of a pipeline makes the same call at the same time, with parts that hold values.

``step`` on one rank and ``eval_step`` on another (or one rank a step ahead) pair a training
forward with an evaluation one: the messages match, then one side waits for gradients that never
come and a transport error follows much later, naming nothing. :class:`CallAgreement` gathers,
before each call's first message, what each rank is about to do - which call, its number, and
whether its parts hold parameters on the meta device (no values: a model never materialised) -
one ``all_gather`` of three int64 numbers per call, and raises the same
:class:`~pp_core.errors.ConfigError` on every rank when they differ, naming each rank's call.
"""

from __future__ import annotations

import torch

from pp_core.errors import ConfigError, PipelineError

__all__ = ["CallAgreement"]

_KINDS = ("step", "eval_step")


def _on_meta(parts) -> bool:
    return any(t.is_meta for part in parts for t in (*part.parameters(), *part.buffers()))


class CallAgreement:
    """The calls one rank made; :meth:`check` is a collective over the pipeline's group."""

    def __init__(self, group, num_ranks: int, device):
        device = torch.device(device)
        self.group, self.num_ranks = group, num_ranks
        self.device = torch.device("cpu") if device.type == "meta" else device
        self.calls = 0

    def check(self, kind: str, parts, timeout=None) -> None:
        """``timeout``: a ``timedelta`` the gathering may take (the pipeline's wait timeout), so
        a rank that never makes the call is reported, not waited for."""
        self.calls += 1
        meta = _on_meta(parts)
        if self.num_ranks > 1:
            import torch.distributed as dist  # lazy: a single-process pipeline needs none

            mine = torch.tensor([_KINDS.index(kind), self.calls, int(meta)], dtype=torch.int64,
                                device=self.device)
            gathered = [torch.empty_like(mine) for _ in range(self.num_ranks)]
            work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
            try:
                work.wait(timeout) if timeout is not None else work.wait()
            except RuntimeError as exc:
                raise PipelineError(
                    f"the other pipeline ranks did not begin a step within "
                    f"{timeout.total_seconds():g} s of this rank's {kind}() (call {self.calls}): "
                    f"one stopped or failed before it, or calls something else ({exc})"[:800]
                ) from None
            table = torch.stack(gathered).cpu().tolist()
        else:
            table = [[_KINDS.index(kind), self.calls, int(meta)]]
        held = [rank for rank, row in enumerate(table) if row[2]]
        if held:
            raise ConfigError(
                f"pipeline rank(s) {held} hold parameters or buffers on the meta device (no "
                f"values) at {kind}(); materialise the model before build_pipeline (build it "
                f"on a real device, or call part.to_empty(device=...) and initialise each of "
                f"pipe.model_parts)")
        if any(row[:2] != table[0][:2] for row in table):
            said = "; ".join(f"rank {rank} calls {_KINDS[row[0]]} (its call {row[1]})"
                             for rank, row in enumerate(table))
            raise ConfigError(
                f"the pipeline ranks do not make the same call: {said}; every rank must call "
                f"step() or eval_step() alike, in the same order (a step on one rank and an "
                f"evaluation on another would pair wrong messages)")
