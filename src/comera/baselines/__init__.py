"""The baselines CoMERA is compared with, each a :class:`comera.methods.Method` selectable as
``comera train WORKLOAD --method NAME``: ``galore`` (:mod:`comera.baselines.galore`), ``apollo``
(:mod:`comera.baselines.apollo`), ``lte`` (:mod:`comera.baselines.lte`) and ``cola``
(:mod:`comera.baselines.cola`); ``dense`` lives in :mod:`comera.methods`. Importing a module registers its
method; ``galore`` and ``apollo`` need the optional packages of ``pip install 'comera[baselines]'``.
"""
