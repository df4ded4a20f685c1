"""The command layer: what ``comera train``, ``comera compare``, ``comera generate`` and ``comera demo`` do
(:mod:`.train`, :mod:`.compare`, :mod:`.generate`, :mod:`.demo`), above the workloads and the benchmarks;
:mod:`comera.cli` dispatches to them."""
