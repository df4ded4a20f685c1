"""The sentence-pair workload (``comera train nli``): the six-encoder transformer (:mod:`.model`), MNLI and
the embedded docstring-code task (:mod:`.data`, :mod:`.pairs`), the recipe (:mod:`.recipe`), its presets
(:mod:`.presets`) and the training-step benchmark ``comera bench transformer`` (:mod:`.bench`)."""
