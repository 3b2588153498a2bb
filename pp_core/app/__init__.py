"""The YAML application: ``pp-core`` commands, the run spec, checks before launch, the launcher,
the training loop, checkpoints, the run recorder and progress.

It is built on the library (``pp_core`` outside this package) and nothing in the library imports
it back. Imports nothing itself, so ``pp-core schedule ...`` pays only for what it uses.
"""
