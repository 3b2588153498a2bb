"""Point-to-point operations between pipeline ranks, and how a failure on one rank reaches the others.

A *message* is what one SEND/RECV pair of the lowered program moves: the tensors a stage hands
to the next (forward) or the input gradients it hands back (backward); :class:`P2P` issues and
waits on its operations, :mod:`pp_core.runtime.mailbox` orders them per peer and
:mod:`pp_core.runtime.wire` lays them out.

Failures. A rank that fails publishes ``"rank r, stage s, action a: cause"`` under a key of the
process group's store and then destroys the process group, which closes its connections: peers
blocked on it fail at once instead of waiting for a timeout, read the published cause and raise
it. A peer that dies without publishing is reported as lost. ``timeout`` bounds every wait.
"""

from __future__ import annotations

import datetime
import gc
from typing import Optional

import torch
import torch.distributed as dist

from pp_core._torch_compat import process_group_store

__all__ = ["P2P", "PeerFailure", "publish"]


class PeerFailure(Exception):
    """A wait ended because a peer failed or vanished; ``str()`` is the peer's own report when
    it published one (``published``), else what this rank observed (a timeout, a lost peer)."""

    def __init__(self, text: str, published: bool = True):
        super().__init__(text)
        self.published = published


class P2P:
    """Sends, receives and waits on one process group; turns a peer's failure into an error.

    :param group: the pipeline's process group (``None`` only for a single-rank pipeline).
    :param timeout: seconds any single wait may take (``None``: the process group's timeout).
    """

    def __init__(self, group, device: torch.device, timeout: Optional[float], key: str,
                 rank: int = 0):
        self.group = group
        self.device = device
        self.rank = rank
        self.timeout_s = timeout
        self.timeout = None if timeout is None else datetime.timedelta(seconds=float(timeout))
        self.store = None
        if group is not None:
            self.store = process_group_store(group)  # kept alive: rank 0 may host it
        self.error_key = f"pp_core/{key}/error"
        self.broken: Optional[str] = None
        self.ordered = _matches_in_order(group)
        """Whether the backend pairs operations between two ranks in issue order, ignoring tags
        (NCCL, and any backend not known to match by tag)."""

    # -------------------------------------------------------------- operations
    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        try:
            return self.group.send([tensor], peer, tag)
        except Exception as exc:  # gloo: the pair was closed by the peer
            raise PeerFailure(*self.peer_report(exc, peer)) from exc

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        try:
            return self.group.recv([tensor], peer, tag)
        except Exception as exc:
            raise PeerFailure(*self.peer_report(exc, peer)) from exc

    def wait(self, work, peer: int) -> None:
        """Block until ``work`` is done (on NCCL: until the current stream waits for it)."""
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(self.timeout)
        except Exception as exc:  # gloo: "Connection closed by peer", timeouts, ...
            raise PeerFailure(*self.peer_report(exc, peer)) from exc

    # -------------------------------------------------------------- failures
    def peer_report(self, exc: BaseException, peer: int) -> tuple[str, bool]:
        """What a failed peer published (``(text, True)``); else what this rank saw happen to
        ``peer`` (``(text, False)``)."""
        first_line = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        timed_out = "timed out" in first_line.lower() or "timeout" in first_line.lower()
        if self.store is not None:
            try:  # a failing peer publishes before it closes its connections
                if not timed_out:
                    self.store.wait([self.error_key], datetime.timedelta(seconds=2))
                if self.store.check([self.error_key]):
                    return self.store.get(self.error_key).decode(errors="replace"), True
            except Exception:  # nothing published (the process died), or the store is gone
                pass
        if timed_out:
            limit = f"{self.timeout_s:g} s" if self.timeout_s else "the process group's timeout"
            return (f"rank {self.rank} waited longer than {limit} for rank {peer}, which is stuck "
                    f"or much slower; if it is just slow, raise distributed.timeout_s (a pipeline "
                    f"file), timeout= (build_pipeline) or $PP_CORE_TIMEOUT "
                    f"({first_line})"), False
        return (f"rank {self.rank} lost its connection to rank {peer}, whose process probably "
                f"died ({type(exc).__name__}: {first_line})"), False

    def peer_failed(self) -> Optional[str]:
        """A peer's published failure, if any (one cheap store lookup)."""
        if self.store is None:
            return None
        try:
            if self.store.check([self.error_key]):
                return self.store.get(self.error_key).decode(errors="replace")
        except Exception:
            return None
        return None

    def publish_and_abort(self, message: str) -> None:
        """Tell the peers why this rank stops, then close its connections so none waits on it."""
        if self.broken is not None:
            return
        self.broken = message
        if self.store is None:
            return
        publish(self.store, self.error_key, message)
        group, self.group = self.group, None
        try:
            if dist.is_initialized():
                if group is dist.group.WORLD:
                    dist.destroy_process_group()
                else:
                    dist.destroy_process_group(group)
        except Exception:
            pass
        del group
        gc.collect()  # pending Work objects hold the connections open


def publish(store, key: str, message: str) -> None:
    """Set ``key`` to ``message`` unless a rank already did (the first failure is the cause)."""
    try:
        if not store.check([key]):
            store.set(key, message)
    except Exception:
        pass


def _matches_in_order(group) -> bool:
    if group is None:
        return True
    try:
        return dist.get_backend(group) != "gloo"
    except Exception:  # not a registered group: assume the stricter rule
        return True
