"""Data loaders and the embedded default tasks of the workloads."""
