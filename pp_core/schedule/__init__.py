"""The schedule half of pp-core: pure Python, no process group, no tensors."""

from pp_core.schedule.ir import (
    B,
    COMM_KINDS,
    COMPUTE_KINDS,
    F,
    I,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    W,
    Action,
    ActionKind,
    Placement,
    Schedule,
    ScheduleDef,
    format_actions,
    parse_action,
    stage_to_rank,
)
from pp_core.schedule.validate import validate_schedule
from pp_core.schedule.build import build_schedule
from pp_core.schedule.simulate import Costs, SimResult, simulate
from pp_core.schedule.csv_io import read_csv, write_csv

__all__ = [
    "Action",
    "ActionKind",
    "F",
    "B",
    "I",
    "W",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "parse_action",
    "format_actions",
    "Placement",
    "ScheduleDef",
    "Schedule",
    "stage_to_rank",
    "validate_schedule",
    "build_schedule",
    "Costs",
    "SimResult",
    "simulate",
    "read_csv",
    "write_csv",
]
