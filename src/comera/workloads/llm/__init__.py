"""Workload 4: LLaMA-style causal language-model pre-training (the decoder and its tensorization presets)."""
