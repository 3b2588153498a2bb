"""The YAML application: pipeline files, validation, launching and training runs (``pp-core run``)."""
