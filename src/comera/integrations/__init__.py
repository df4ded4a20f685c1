"""CoMERA inside other libraries' training loops: ``CoMERATrainer`` and ``CoMERACallback`` for
``transformers.Trainer``, the chunked causal-LM loss and ``comera.from_pretrained``; the modules import
``transformers`` (``pip install 'comera[hf]'``), this package's ``__init__`` and ``import comera`` do not.
Details: docs/training.md, 'Training with Hugging Face's Trainer'.
"""
