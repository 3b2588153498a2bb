"""Planning: decide how a model is split and scheduled, before any process group (pure; meta
or measured inputs only). Imports nothing heavy, so schedule commands stay torch-free."""
