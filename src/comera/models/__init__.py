"""Reference models of the workloads, each registered for ``comera.load_pretrained``."""
