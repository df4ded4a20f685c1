"""Reference models, one per workload, registered for ``comera.load_pretrained``."""
