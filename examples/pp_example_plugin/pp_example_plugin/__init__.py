"""An example pp-core plugin: a model whose blocks share one process-local position table.

This module is what the entry point loads, and pp-core loads every plugin for every command,
``pp-core schedule`` included. So it holds only the hooks, and they import the model module
(which imports torch) when pp-core asks for models or datasets: a schedule command then never
pays for torch. The model, dataset and resource live in :mod:`pp_example_plugin.model`.
"""

import pp_core

__all__ = ["pp_register_models", "pp_register_datasets"]


@pp_core.hookimpl
def pp_register_models(register):
    from pp_example_plugin.model import ExampleMLP

    register("example_mlp", ExampleMLP)


@pp_core.hookimpl
def pp_register_datasets(register):
    from pp_example_plugin.model import example_regression

    register("example_regression", example_regression)
