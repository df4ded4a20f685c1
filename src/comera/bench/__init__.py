"""Benchmarks reachable as ``comera bench NAME``: each submodule ``NAME`` exposes ``main(argv) -> int``."""

BENCHMARKS = (
    "layers",
    "embedding",
    "inference",
    "trainer",
    "transformer",
    "attention",
    "dlrm",
    "mlm",
    "paper",
    "meta_memory",
)
