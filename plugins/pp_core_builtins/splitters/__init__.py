"""Built-in model splitters ``fqn``, ``layers`` and ``sequential``: one module and entry point each.

Each registers through ``pp_register_splitters`` exactly as a third-party splitter would. Their
``priority`` attributes (300, 200, 100) fix the automatic-selection order independently of the
order in which entry points load; see ``docs/splitting.md``.
"""
