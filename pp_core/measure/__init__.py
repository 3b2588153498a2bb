"""Measuring a model and the machine before planning: per-unit costs (``profile``), the link
between ranks (``link``), the executor's own time per action (``overhead``), allocation
accounting (``transient``, ``held_for_weight``) and the auto planner's driver (``plan_auto``).

Above the runtime (it runs the runtime's stages and backward to time them) and beside the
application: the executor never imports it.
"""
