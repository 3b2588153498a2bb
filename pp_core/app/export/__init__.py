"""The hand-back chapter: a run's weights written out for the tools users bring next.

``hf`` plans a Hugging Face directory (``save_pretrained`` or the directory form), ``stream``
writes it from a checkpoint or from the ranks, ``run`` is ``checkpoint.export_hf`` (the ranks
write it as the run ends), ``peft`` a LoRA run's adapter, ``described`` what a checkpoint records
at save time to describe the model, ``staging`` the write beside and rename in whole. ``pp-core
export`` picks among them
(:mod:`pp_core.app.commands.export`).
"""
