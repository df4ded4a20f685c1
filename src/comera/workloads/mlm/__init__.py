"""The masked-LM workload (``comera train mlm``): the RoBERTa model (:mod:`.model`, its ``transformers`` side
in :mod:`.hf_model`), its data (:mod:`.data`: packing in :mod:`.packing`, masking in :mod:`.masking`), the
recipe (:mod:`.recipe`), its presets (:mod:`.presets`) and the training-step benchmark ``comera bench mlm``
(:mod:`.bench`)."""
