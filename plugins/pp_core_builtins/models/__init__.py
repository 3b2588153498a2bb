"""pp-core's demo models and datasets, registered exactly as a third-party plugin would.

Models: ``gpt`` (a small decoder-only transformer following the ``layers`` contract) and
``uneven_gpt`` (the same with a large vocabulary and blocks of two widths: uneven costs),
``moe_gpt`` (the same with mixture-of-experts feed-forward blocks; ``moe_gpt.py``).
Datasets: ``synthetic`` (a learnable bigram language or a linear regression, no files needed),
``text_bytes`` (byte-level language modelling over a text file; a public-domain text ships in
``plugins/pp_core_builtins/models/data/``) and ``tokenized_text`` (a corpus of local files with a
local tokenizer, tokenized once into a cache; packed or padded rows: docs/data.md).

Neither loading this entry point nor registering its models and datasets imports torch
(``pp-core schedule`` and ``pp-core plugins`` load every plugin and must stay fast): they are
registered by name (:class:`pp_core.callables.LazyCallable`) and their modules load when one is
called, and ``from pp_core_builtins.models import GPT`` loads ``pp_core_builtins.models.gpt``
on first use.
"""


from pp_core import hookimpl
from pp_core.callables import LazyCallable
from pp_core.lazy import lazy_face

__all__ = ["GPT", "synthetic", "text_bytes", "tokenized_text"]

_HOMES = {"GPT": "pp_core_builtins.models.gpt", "synthetic": "pp_core_builtins.models.datasets",
          "text_bytes": "pp_core_builtins.models.datasets",
          "tokenized_text": "pp_core_builtins.models.tokenized"}

__getattr__, __dir__ = lazy_face(__name__, _HOMES)


@hookimpl
def pp_register_models(register):
    # by name, imported on first use: torch stays off the plugin listing
    register("gpt", LazyCallable("pp_core_builtins.models.gpt:GPT"))
    register("uneven_gpt", LazyCallable("pp_core_builtins.models.gpt:uneven_gpt"))
    register("moe_gpt", LazyCallable("pp_core_builtins.models.moe_gpt:MoEGPT"))


@hookimpl
def pp_register_datasets(register):
    register("synthetic", LazyCallable("pp_core_builtins.models.datasets:synthetic"))
    register("text_bytes", LazyCallable("pp_core_builtins.models.datasets:text_bytes"))
    register("tokenized_text", LazyCallable("pp_core_builtins.models.tokenized:tokenized_text"))


@hookimpl
def pp_tensor_parallel_plan(model, sequence_parallel):
    """The demo GPT's plan (``gpt`` and ``uneven_gpt``: ``tp_plan.py``)."""
    if type(model).__name__ != "GPT":  # cheap: torch and the model module load only for a GPT
        return None
    from pp_core_builtins.models.tp_plan import gpt_plan  # lazy: torch, only for a tp plan

    return gpt_plan(model, sequence_parallel)
