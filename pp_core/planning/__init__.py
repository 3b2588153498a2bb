"""Planning: decide how a model is split and scheduled, before any process group (pure; meta
or measured inputs only). Imports nothing heavy, so schedule commands stay torch-free.

The choice among plans is :func:`pp_core.planning.choose.choose_plan`; profiling a real model and
choosing (``pp_schedule: auto``) is :func:`pp_core.plan_auto`, which runs in the runtime."""
