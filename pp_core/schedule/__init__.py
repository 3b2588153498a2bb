"""The schedule half of pp-core: pure Python, no process group, no tensors."""

from pp_core.schedule import ir
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

# the IR's public names are the package's, plus the operations on schedules
__all__ = [
    *ir.__all__,
    "validate_schedule",
    "build_schedule",
    "Costs",
    "SimResult",
    "simulate",
    "read_csv",
    "write_csv",
]
