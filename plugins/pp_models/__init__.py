"""pp-core's demo models and datasets, registered exactly as a third-party plugin would.

Models: ``gpt`` (a small decoder-only transformer following the ``layers`` contract).
Datasets: ``synthetic`` (a learnable bigram language or a linear regression, no files needed)
and ``text_bytes`` (byte-level language modelling over a text file; a public-domain text ships in
``pp_models/data/``).
"""

from pp_core import hookimpl
from pp_models.datasets import synthetic, text_bytes
from pp_models.gpt import GPT

__all__ = ["GPT", "synthetic", "text_bytes"]


@hookimpl
def pp_register_models(register):
    register("gpt", GPT)


@hookimpl
def pp_register_datasets(register):
    register("synthetic", synthetic)
    register("text_bytes", text_bytes)
