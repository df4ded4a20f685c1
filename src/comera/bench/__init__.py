"""Benchmarks reachable as ``comera bench NAME``: each module of :data:`BENCHMARKS` exposes
``main(argv) -> int`` and runs as ``python -m MODULE`` in a fresh process; a workload's own benchmark stays in
its folder and is named here by module path, so nothing below this package imports it. Details:
docs/benchmarks.md."""

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
