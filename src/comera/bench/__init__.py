"""Benchmarks reachable as ``comera bench NAME``: each module of :data:`BENCHMARKS` exposes
``main(argv) -> int`` and is run with ``python -m MODULE`` in a fresh process.

The layer benchmarks live here; a workload's own benchmark lives in its folder (``workloads/NAME/bench.py``)
and is named here by module path, so this package sits above the workloads and nothing below imports it.
"""

BENCHMARKS: dict[str, str] = {
    "layers": "comera.bench.layers",
    "embedding": "comera.bench.embedding",
    "inference": "comera.bench.inference",
    "trainer": "comera.bench.trainer",
    "transformer": "comera.workloads.nli.bench",
    "attention": "comera.bench.attention",
    "dlrm": "comera.workloads.dlrm.bench",
    "mlm": "comera.workloads.mlm.bench",
    "paper": "comera.bench.paper",
    "meta_memory": "comera.bench.meta_memory",
    "scaling": "comera.bench.scaling",
    "gpu": "comera.bench.gpu",
    "llm": "comera.bench.llm",
    "hf_llama": "comera.bench.hf_llama",
}
"""Benchmark name -> the module ``comera bench NAME`` runs."""
