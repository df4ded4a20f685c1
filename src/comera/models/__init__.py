"""One readable model per workload, registered for ``comera.load_pretrained``."""
