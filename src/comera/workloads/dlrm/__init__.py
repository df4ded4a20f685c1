"""The click-through workload (``comera train dlrm``): DLRM (:mod:`.model`), Criteo logs (:mod:`.criteo`), the
synthetic click log (:mod:`.synthetic`), click batches (:mod:`.clicks`), the recipe (:mod:`.recipe`), its
presets (:mod:`.presets`) and the training-step benchmark ``comera bench dlrm`` (:mod:`.bench`)."""
