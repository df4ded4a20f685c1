"""Data loaders of the workloads and their embedded defaults."""
