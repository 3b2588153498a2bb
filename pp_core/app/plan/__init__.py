"""The whole-layout planner (``pp-core plan FILE --world N``): every pp x dp x tp x ep layout of
N ranks planned, measured where it must be, and ranked - a chapter of its own, so ``launch/``
only launches.

``plan_world`` ranks the layouts (:func:`~pp_core.app.plan.plan_world.plan_world`);
``pipeline_factor`` measures how much more a unit costs inside a running pipeline than alone;
``timed_layouts`` runs one layout per tp / ep degree pair a few steps to set that pair's level.
It plans each layout as a run would (:mod:`pp_core.app.launch.decide`) and times layouts with
the training loop (:mod:`pp_core.app.rank`), so it sits above both.
"""
