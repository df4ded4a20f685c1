"""Data loaders and generators of the workloads."""
