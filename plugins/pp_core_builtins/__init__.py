"""pp-core's built-in plugins: schedules, splitters, the receive-buffer pool, the demo model and
datasets, Hugging Face transformers. Each subpackage is registered through the root
pyproject's ``pp_core`` entry points exactly as a third party's plugin is, under an import name
no third party would pick. Imports nothing: a schedule command loads only what it needs.
"""
