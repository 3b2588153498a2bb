"""Every rank of a pipeline agreeing, checked before it could go wrong silently.

``build``: the ranks built the same pipeline (configuration, model, schedule, split), checked by
``build_pipeline`` before the first step; ``calls``: the ranks make the same call at the same time
(``step`` against ``eval_step``, a rank a step ahead), checked before each call's first message.
Both gather a few hashes or numbers and raise the same error on every rank.
"""
