"""pp-core's demo models and datasets, registered exactly as a third-party plugin would.

Models: ``gpt`` (a small decoder-only transformer following the ``layers`` contract) and
``uneven_gpt`` (the same with a large vocabulary and blocks of two widths: uneven costs).
Datasets: ``synthetic`` (a learnable bigram language or a linear regression, no files needed)
and ``text_bytes`` (byte-level language modelling over a text file; a public-domain text ships in
``pp_models/data/``).

Loading this entry point does not import torch (``pp-core schedule`` loads every plugin and must
stay fast): the hooks import the model and dataset modules when pp-core asks for models or
datasets, and ``from pp_models import GPT`` loads ``pp_models.gpt`` on first use.
"""

import importlib

from pp_core import hookimpl

__all__ = ["GPT", "synthetic", "text_bytes"]

_HOMES = {"GPT": "pp_models.gpt", "synthetic": "pp_models.datasets",
          "text_bytes": "pp_models.datasets"}


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'pp_models' has no attribute {name!r}")


@hookimpl
def pp_register_models(register):
    from pp_models.gpt import GPT, uneven_gpt

    register("gpt", GPT)
    register("uneven_gpt", uneven_gpt)


@hookimpl
def pp_register_datasets(register):
    from pp_models.datasets import synthetic, text_bytes

    register("synthetic", synthetic)
    register("text_bytes", text_bytes)
