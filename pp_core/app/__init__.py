"""The YAML application, in chapters read in the order a run lives them:

``spec/`` reads the file; ``check/`` is ``pp-core validate`` (everything checked before a process
starts, the resume against what its checkpoint was written for included); ``launch/`` decides
once (auto, balanced, or as written) and starts the ranks; ``rank/`` is one rank's life (the
training loop, health, metrics, outputs, progress); ``plan/`` is ``pp-core plan --world`` (the
whole layout chosen); ``export/`` hands the weights back (Hugging Face, PEFT, a flat file);
``commands/`` is each ``pp-core`` sub-command, one module each. Beneath them a small shared
ground: ``cli``, ``logs``, ``interrupts``, ``rendezvous``, ``factories`` (the one model recipe),
``adapters`` (LoRA, freezing), ``machine`` (this machine's share of the run), ``output_paths``.

It is built on the library (``pp_core`` outside this package) and nothing in the library imports
it back. Imports nothing itself, so ``pp-core schedule ...`` pays only for what it uses.
"""
