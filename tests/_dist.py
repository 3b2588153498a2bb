"""Multi-rank test helpers; the implementation lives in :mod:`pp_core.testing.dist_pool`."""

from pp_core.testing.dist_pool import DistPool, Outcome, RankError

__all__ = ["DistPool", "Outcome", "RankError"]
