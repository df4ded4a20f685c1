"""CoMERA inside other libraries' training loops.

- :mod:`comera.integrations.hf_trainer`: :class:`~comera.integrations.hf_trainer.CoMERATrainer`, a
  ``transformers.Trainer`` that trains a tensorized model with CoMERA's rank objective, param groups, stages
  and prune points, logs the model size and saves with :func:`comera.save_pretrained`;
- :mod:`comera.integrations.hf_stages`: :class:`~comera.integrations.hf_stages.CoMERACallback`, the
  ``TrainerCallback`` that runs the host-side schedule (controller step, late stage, prune points);
- :mod:`comera.integrations.hf_loss`: :func:`~comera.integrations.hf_loss.chunked_causal_lm_loss`, a causal
  LM's loss in chunks of tokens without the whole logits, and
  :class:`~comera.integrations.hf_loss.ChunkedLossTrainer`, a ``transformers.Trainer`` that trains with it;
- :mod:`comera.integrations.hf_pretrained`: :func:`~comera.integrations.hf_pretrained.from_pretrained`
  (``comera.from_pretrained``), a saved tensorized ``transformers`` model back in one call.

These modules import ``transformers``, an optional dependency (``pip install 'comera[hf]'``, which also brings
``accelerate``, required by ``transformers.Trainer``); this package's ``__init__`` imports neither, and
``import comera`` imports nothing from here (``comera.from_pretrained`` imports its module on first use).
"""
