"""Restart in place: what a rank that torch's elastic agent started again resumes from, and the
run's account of its failures (restarts, steps redone, recovery time, goodput).

A rank knows it was started again from ``TORCHELASTIC_RESTART_COUNT``, which the agent sets both
under ``pp-core run`` (``distributed.max_restarts``) and under ``torchrun --max-restarts``, so
nothing here depends on pp-core's launcher. A restarted rank resumes from the latest complete
checkpoint in ``checkpoint.dir`` *saved by this launch* (its ``.metadata`` is newer than the
launch: ``$PP_CORE_LAUNCH_STARTED``, which ``pp-core run`` sets, or else the start of the rank's
parent process, torchrun's agent), whatever ``checkpoint.resume`` says; when this launch saved
none yet it does what the first attempt did (``checkpoint.resume``). So a fresh run into a
directory that holds an older run's checkpoints never resumes those after a failure.

The account lives in ``<checkpoint.dir>/.pp_core_attempts.json`` (:data:`HISTORY`), written by
the first rank whenever restarts are possible: per attempt, when it started, the step it resumed
from, its last completed step and when, and the step time spent up to each checkpoint it saved
(the time a later failure does not lose). It is replaced whole after each step (a small JSON
object, renamed in), so a rank killed at any instant leaves the last step's account.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

__all__ = ["HISTORY", "restart_count", "launch_clock", "launch_started", "restarts_used",
           "resume_setting", "launch_checkpoint", "agreed_resume", "join_group", "Attempts"]

HISTORY = ".pp_core_attempts.json"
LAUNCH_ENV = "PP_CORE_LAUNCH_STARTED"
KEPT_SAVES = 4  # the cumulative step time at this many of an attempt's last saves is kept


def restart_count() -> int:
    """How many times the elastic agent restarted this rank's group (0: the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def restarts_allowed() -> int:
    """``max_restarts`` as the agent that started this rank was given it (0 without one)."""
    try:
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return 0


@contextlib.contextmanager
def launch_clock(max_restarts: int = 0):
    """While the ranks run, they inherit the wall-clock time this launch started at; with
    restarts, each rendezvous round gets a TCPStore of its own (torch's agent otherwise shares
    one across rounds, and a restarted rank can read a dead one's address: pytorch#135712)."""
    changes = {LAUNCH_ENV: repr(time.time())}
    if max_restarts > 0:
        changes["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    previous = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def join_group(backend: str, timeout) -> None:
    """``init_process_group`` from the environment; after a restart under an agent that shares
    its store across rounds (``torchrun``'s default), under a prefix of this attempt's own, so
    that no key a rank of the failed attempt wrote is read (pytorch#135712)."""
    import torch.distributed as dist  # lazy: torch, on the ranks only

    count = restart_count()
    if not count or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"pp_core/attempt_{count}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout)


def launch_started() -> float | None:
    """When this launch began: pp-core's launcher says so; under torchrun, the start of the
    agent (this rank's parent, read from ``/proc``); None where neither can be known."""
    try:
        return float(os.environ[LAUNCH_ENV])
    except (KeyError, ValueError):
        pass
    try:
        stat = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(stat[19])  # field 22, after pid and (comm): jiffies after boot
        boot = next(float(line.split()[1]) for line in
                    Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def restarts_used(max_restarts: int) -> str:
    """What the launcher adds to the message of a failure that ended the run."""
    if max_restarts <= 0:
        return ""
    return (f"; the run ended after {max_restarts} restart(s), all that distributed.max_restarts "
            f"allows")


def resume_setting(spec):
    """What this rank resumes from: ``checkpoint.resume`` on the first attempt; after a restart,
    the latest complete checkpoint this launch saved (a path), or ``checkpoint.resume`` when it
    saved none yet. An elastic run (``nnodes: "MIN:MAX"``) asks :func:`agreed_resume`."""
    if spec.distributed.elastic:
        return agreed_resume(spec)
    if restart_count() == 0:
        return spec.checkpoint.resume
    return launch_checkpoint(spec) or spec.checkpoint.resume


def launch_checkpoint(spec) -> str | None:
    """The latest complete checkpoint in ``checkpoint.dir`` that this launch saved, or None."""
    directory = spec.checkpoint.dir
    if not directory:
        return None
    from pp_core.checkpoint.directory import latest_checkpoint  # lazy: DCP

    latest = latest_checkpoint(directory)
    since = launch_started()
    if latest is not None:
        saved = (latest / ".metadata").stat().st_mtime
        if since is None or saved >= since:
            return str(latest)
    return None


def agreed_resume(spec):
    """One resume for every rank of an elastic run, whatever its node saw: the agent restarts a
    group that grows when a node joins without counting a restart (``TORCHELASTIC_RESTART_COUNT``
    stays), and the joining node's launch began after every checkpoint of the run. So each rank
    offers the latest checkpoint its own launch saved, and all take the latest offered (they
    share ``checkpoint.dir``); when none offers one, ``checkpoint.resume``, as on the first
    attempt. One ``all_gather_object`` over the world, after the group is joined."""
    import torch.distributed as dist  # lazy: torch, on the ranks only

    offers: list = [None] * dist.get_world_size()
    dist.all_gather_object(offers, launch_checkpoint(spec))
    found = [offer for offer in offers if offer]
    return max(found, key=lambda path: Path(path).name) if found else spec.checkpoint.resume


class Attempts:
    """The first rank's account of this launch's attempts (:data:`HISTORY`), or nothing when no
    restart is possible (no ``checkpoint.dir``, or ``max_restarts`` 0 and this is the first)."""

    def __init__(self, spec, rank: int, started: float):
        self.count = restart_count()
        directory = spec.checkpoint.dir
        self.enabled = rank == 0 and bool(directory) and (restarts_allowed() > 0 or self.count)
        self.path = Path(directory) / HISTORY if directory else None
        self.launch = launch_started()
        self.previous: list[dict] = self._read() if self.enabled and self.count else []
        self.mine = {"attempt": self.count, "started": started, "resumed_from": 0,
                     "last_step": 0, "last_at": started, "busy_s": 0.0, "kept": {}}
        self.recovery: dict | None = None  # this attempt's recovery, once its first step is done

    def _read(self) -> list[dict]:
        try:
            found = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        if not isinstance(found, dict) or found.get("launch") != self.launch:
            return []  # another launch's account
        return [a for a in found.get("attempts", []) if isinstance(a, dict)]

    def resumed(self, step: int) -> str | None:
        """Note the step this attempt resumed from; the line the user sees after a restart."""
        self.mine.update(resumed_from=step, last_step=step)
        if not self.count:
            return None
        failed = self.previous[-1]["last_step"] if self.previous else None
        redone = "" if failed is None or failed <= step else \
            f"; steps {step + 1}..{failed} are done again"
        return (f"restart {self.count} of {restarts_allowed()}: every rank was started again "
                f"after a failure and resumed at step {step}{redone}")

    def step_done(self, step: int, seconds: float) -> dict | None:
        """Note a completed step; returns this attempt's recovery once, at its first step."""
        now, found = time.time(), None
        mine = self.mine
        mine["busy_s"] += seconds
        mine.update(last_step=step, last_at=now)
        if self.count and self.recovery is None and self.previous:
            failed = self.previous[-1]
            self.recovery = {
                "restart": self.count, "failed_after_step": failed["last_step"],
                "resumed_from": mine["resumed_from"],
                "steps_redone": max(0, failed["last_step"] - mine["resumed_from"]),
                "recovery_s": round(now - failed["last_at"], 3),  # last progress -> this step
                "down_s": round(mine["started"] - failed["last_at"], 3),  # detect + restart
                "startup_s": round(now - seconds - mine["started"], 3),  # build + load
                "first_step_s": round(seconds, 3)}
            mine["recovery"] = found = self.recovery
        self._write()
        return found

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` is complete: the step time up to it survives a failure."""
        kept = self.mine["kept"]
        kept[str(step)] = self.mine["busy_s"]
        for old in sorted(kept, key=int)[:-KEPT_SAVES]:
            del kept[old]

    def _write(self) -> None:
        if not self.enabled:
            return
        staging = self.path.with_name(f"{HISTORY}.tmp-{os.getpid()}")
        try:
            staging.write_text(json.dumps({"launch": self.launch,
                                           "attempts": [*self.previous, self.mine]}),
                               encoding="utf-8")
            os.replace(staging, self.path)
        except OSError:
            pass  # an account, not the run: a full disk says so when the checkpoint is saved

    def summary(self, wall_end: float) -> dict | None:
        """Restarts, steps redone, each recovery and goodput (the share of the launch's wall
        time spent on steps that were kept), or None for a run that never restarted."""
        if not self.count or not self.previous:
            return None
        attempts = [*self.previous, self.mine]
        kept = self.mine["busy_s"]
        for attempt, following in zip(attempts, attempts[1:]):
            kept += attempt.get("kept", {}).get(str(following["resumed_from"]), 0.0)
        begun = self.launch if self.launch is not None else attempts[0]["started"]
        redone = sum(max(0, a["last_step"] - b["resumed_from"])
                     for a, b in zip(attempts, attempts[1:]))
        recoveries = [a["recovery"] for a in attempts if a.get("recovery")]
        return {"restarts": self.count, "steps_redone": redone, "recoveries": recoveries,
                "goodput": kept / max(wall_end - begun, 1e-9), "wall_s": wall_end - begun}
