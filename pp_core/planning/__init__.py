"""Planning: decide how a model is split and scheduled, before any process group (pure; meta
or measured inputs only). Imports nothing heavy, so schedule commands stay torch-free."""

from pp_core.planning.choose import Ranking, choose_plan
from pp_core.planning.auto import AutoPlan, plan_auto

__all__ = ["AutoPlan", "Ranking", "choose_plan", "plan_auto"]
