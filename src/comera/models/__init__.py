"""Reference models of the workloads (transformer classifier, DLRM, RoBERTa masked LM)."""
