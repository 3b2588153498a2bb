"""Multi-rank test helpers; the implementation lives in :mod:`pp_core.testing_dist`."""

from pp_core.testing_dist import DistPool, Outcome, RankError

__all__ = ["DistPool", "Outcome", "RankError"]
