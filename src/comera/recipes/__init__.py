"""The recipe engine: what a workload recipe is (:mod:`.base`), a run's settings (:mod:`.settings`), the run
that trains one and writes its folder (:mod:`.run`, :mod:`.folders`, :mod:`.fingerprint`). The workloads
themselves live in :mod:`comera.workloads`, above this package."""
