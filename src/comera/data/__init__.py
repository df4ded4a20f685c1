"""Data of the reference workloads: loaders of the public formats, the embedded default data, batching."""
