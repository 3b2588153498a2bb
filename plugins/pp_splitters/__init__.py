"""Built-in model splitters ``fqn``, ``layers``, ``sequential`` and ``balanced``: one module and
entry point each.

Each registers through ``pp_register_splitters`` exactly as a third-party splitter would. Their
``priority`` attributes (300, 200, 100) fix the automatic-selection order independently of the
order in which entry points load; ``balanced`` (-1000, it needs a measured profile) is only used
when named. See ``docs/splitting.md``.
"""
