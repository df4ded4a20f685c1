"""Measuring helpers shared by the benchmarks and the command layer: timing medians, peak memory, where a
step's operator time goes, the machine description, docs/benchmarks.md sections, plots. It imports only the
base and the tensor math."""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from comera.atomic import atomic_write_bytes
from comera.cpu import reset_peak_resident, status_kib
from comera.tt.recycle import output_pool

__all__ = [
    "median_ms",
    "interleaved_medians_ms",
    "machine_description",
    "OPERATOR_CATEGORIES",
    "category_of",
    "profile_steps",
    "source_commit",
    "update_section",
    "markdown_file_argument",
    "peak_rise_mib",
    "training_state_mib",
    "weights_optimizer_mib",
    "status_kib",
    "status_mib",
    "fmt",
    "ratio",
    "pyplot",
    "grouped_bars",
    "ALLOCATION",
    "allocation_of",
    "add_memory_argument",
]

ALLOCATION = {"reuse": "`comera.cpu.reuse_freed_memory()`", "default": "glibc's default"}
"""The words for a benchmark's ``--memory`` setting of its timed steps."""


def add_memory_argument(parser: argparse.ArgumentParser) -> None:
    """``--memory {reuse,default}``: the allocation setting of a benchmark's timed steps."""
    parser.add_argument(
        "--memory",
        choices=tuple(ALLOCATION),
        default="reuse",
        help="'reuse': comera.cpu.reuse_freed_memory() before the timed steps, as the Trainer does on CPU "
        "(default); 'default': glibc's setting",
    )


def allocation_of(results: list[dict]) -> str:
    """:data:`ALLOCATION`'s words for the ``memory`` field of ``results`` (cases recorded without it ran
    with glibc's default)."""
    memory = next((result["memory"] for result in results if "memory" in result), "default")
    return ALLOCATION[memory]


def median_ms(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def interleaved_medians_ms(
    fns: dict[str, Callable[[], object]],
    repeats: int = 7,
    warmup: int = 2,
    min_seconds: float = 0.0,
    max_repeats: int = 1000,
) -> dict[str, float]:
    """Median milliseconds of each function, timed round-robin in a fresh (seeded) random order each round so
    load changes hit all of them alike: at least ``repeats`` rounds, more (up to ``max_repeats``) until they
    have taken ``min_seconds``, so short functions get the rounds a stable median needs."""
    if repeats < 1 or max_repeats < repeats:
        raise ValueError(f"repeats must be in [1, max_repeats={max_repeats}], got {repeats}")
    if min_seconds < 0:
        raise ValueError(f"min_seconds must be >= 0, got {min_seconds}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    shuffler = random.Random(0)
    spent, rounds = 0.0, 0
    while rounds < repeats or (spent < min_seconds and rounds < max_repeats):
        shuffler.shuffle(names)
        for name in names:
            start = time.perf_counter()
            fns[name]()
            elapsed = time.perf_counter() - start
            times[name].append(elapsed)
            spent += elapsed
        rounds += 1
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def source_commit() -> str:
    """The short hash of the checkout comera runs from, ``"unknown"`` outside a git checkout (a wheel)."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def machine_description() -> str:
    """One line: CPU model, threads used, torch version and device."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{_cpu_model()}, {torch.get_num_threads()} threads, {os.cpu_count()} logical CPUs, "
        f"torch {torch.__version__}, Python {platform.python_version()}, {device}"
    )


def _missing_folder(path: str | os.PathLike) -> str | None:
    """Why a markdown file cannot be written at ``path`` without making folders, or None."""
    folder = Path(path).absolute().parent
    if folder.is_dir():
        return None
    return (
        f"{path}: its folder {folder} does not exist (no folder is made for it); create it or name a file in "
        "one"
    )


def markdown_file_argument(value: str) -> str:
    """A ``--write`` value (the markdown file a benchmark updates), refused with argparse's one-line error
    before the benchmark runs when its folder does not exist: no folder is made for it (a mistyped
    ``/nonexistent/dir/x.md`` made folders at the file system's root)."""
    problem = _missing_folder(value) if value.strip() else "an empty path; name a markdown file"
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def update_section(path: str | os.PathLike, name: str, body: str) -> None:
    """Replace (or append) the section ``name`` of a markdown file (from ``<!-- bench:NAME:start -->`` to
    ``<!-- bench:NAME:end -->``), written atomically; ``FileNotFoundError`` when its folder does not exist."""
    problem = _missing_folder(path)
    if problem is not None:
        raise FileNotFoundError(problem)
    path = Path(path)
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n\nNumbers produced by `make bench`.\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    atomic_write_bytes(path, text.encode())


def status_mib(field: str, missing: float | None = None) -> float | None:
    """:func:`status_kib` in MiB, ``missing`` where it is unavailable."""
    kib = status_kib(field)
    return missing if kib is None else kib / 1024


def peak_rise_mib(step: Callable[[], object]) -> float:
    """Rise of the peak resident set size over the current one while ``step()`` runs, in MiB, from the
    kernel's high-water mark reset through ``/proc/self/clear_refs`` (elsewhere ``ru_maxrss``, which shows
    only a rise above the process's earlier peak)."""
    if reset_peak_resident():
        before = status_kib("VmRSS")
        step()
        return (status_kib("VmHWM") - before) / 1024
    before = status_kib("VmRSS") or 0
    step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def _reachable_tensors(value: object, visited: set[int], depth: int = 0) -> list[torch.Tensor]:
    """Tensors in ``value``: itself, or inside dicts, lists, tuples and (up to depth 4) the attributes of
    objects, such as a GaLore projector in an optimizer's state."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4 or id(value) in visited or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return []
    visited.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
        items = list(vars(value).values())
    else:
        return []
    return [tensor for item in items for tensor in _reachable_tensors(item, visited, depth + 1)]


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of ``tensors``, each storage once however many tensors view it; a distributed tensor
    (``DTensor``, FSDP2's parameters and their optimizer state) counts its whole logical size once."""
    storages: dict[tuple[str, int], int] = {}
    logical: dict[int, int] = {}
    for tensor in tensors:
        if hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh"):
            logical[id(tensor)] = tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        storages[key] = max(storages.get(key, 0), storage.nbytes())
    return sum(storages.values()) + sum(logical.values())


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    return [] if optimizer is None else _reachable_tensors(list(optimizer.state.values()), set())


def training_state_mib(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> float:
    """MiB of what training keeps between steps, counted tensor by tensor: the model's parameters and
    buffers, the parameters' gradients, and every tensor of the optimizer's state (moments, projection
    matrices of GaLore-style optimizers), plus the free buffers of the TT paths' output pool
    (:mod:`comera.tt.recycle`), which stay allocated between steps. Each storage counts once, however
    many tensors view it."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [param.grad for param in model.parameters() if param.grad is not None]
    tensors += _optimizer_tensors(optimizer)
    return (_storage_bytes(tensors) + output_pool().free_nbytes()) / 2**20


def weights_optimizer_mib(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> float:
    """MiB of the model's parameters plus every tensor of the optimizer's state (moments, step counters,
    GaLore-style projections, however deep in the state), each storage once: the "memory" column of
    GaLore's, APOLLO's and CoLA's pre-training tables, an estimate that leaves out gradients, activations
    and buffers (:func:`training_state_mib` counts what training really keeps)."""
    return _storage_bytes([*model.parameters(), *_optimizer_tensors(optimizer)]) / 2**20


def fmt(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals for a table, ``"n/a"`` for a missing one."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def ratio(numerator: float | None, denominator: float | None, digits: int = 1) -> str:
    """``numerator / denominator`` as ``"2.5x"``; ``"n/a"`` when either is missing or the denominator <= 0."""
    if numerator is None or denominator is None or denominator <= 0:
        return "n/a"
    return f"{numerator / denominator:.{digits}f}x"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def grouped_bars(
    rows: Sequence[Mapping[str, Any]],
    path: Path,
    *,
    group: str,
    series: str,
    value: str,
    xlabel: str,
    ylabel: str,
    order: Sequence[str] = (),
) -> Path | None:
    """Bars on a log scale: a group per value of ``row[group]`` (sorted), a bar per ``row[series]`` (those
    in ``order`` first, in that order, then the others sorted). Rows with an ``error`` or without ``value``
    are left out. Returns ``path``, or None without matplotlib or without a row to draw."""
    plt = pyplot()
    rows = [row for row in rows if "error" not in row and row.get(value) is not None]
    if plt is None or not rows:
        return None
    groups = sorted({row[group] for row in rows})
    present = {row[series] for row in rows}
    names = [name for name in order if name in present] + sorted(present - set(order))
    figure, axes = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        values = {row[group]: row[value] for row in rows if row[series] == name}
        positions = [i + index * width for i, key in enumerate(groups) if key in values]
        heights = [max(values[key], 1e-3) for key in groups if key in values]
        axes.bar(positions, heights, width, label=name)
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [str(key) for key in groups])
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_yscale("log")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def backward_step(module: torch.nn.Module, inputs: torch.Tensor, grad: torch.Tensor | None):
    """A timed step: clear the gradients of ``module`` (and of ``inputs`` where it has one), then
    ``module(inputs)`` and its backward with ``grad`` as the upstream gradient, or, for None, of the
    output's sum (a broadcast upstream gradient)."""

    def step() -> None:
        inputs.grad = None
        module.zero_grad(set_to_none=True)
        out = module(inputs)
        if grad is None:
            out.sum().backward()
        else:
            out.backward(grad)

    return step


OPERATOR_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("optimizer", r"^(aten::_foreach_|aten::_fused_adam|Optimizer\.)"),
    ("attention", r"scaled_dot_product|flash_attention|_efficient_attention|softmax_backward|aten::_softmax"),
    ("embedding and loss", r"embedding|nll_loss|log_softmax|cross_entropy"),
    ("matrix products", r"^aten::(mm|bmm|addmm|baddbmm|matmul|linear|einsum|tensordot|dot|mv|addmv)$"),
    (
        "copies and reshapes",
        r"^aten::(copy_|clone|contiguous|cat|stack|permute|transpose|t|view|reshape|_reshape_alias|expand|"
        r"as_strided|_unsafe_view|unsqueeze|squeeze|select|slice|split|narrow|index_select|empty|empty_like|"
        r"zeros|zeros_like|ones_like|new_zeros|new_empty|flatten|unflatten|detach|alias|to|_to_copy|"
        r"empty_strided|resize_|fill_|zero_)$",
    ),
    ("elementwise", r"^aten::"),
)
"""(category, regular expression on the operator's name), tried in order; an operator no pattern matches
(autograd nodes, profiler records) is ``other``."""

_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in OPERATOR_CATEGORIES)


def category_of(operator: str) -> str:
    """The first category of :data:`OPERATOR_CATEGORIES` whose pattern matches ``operator`` (a profiler key
    such as ``aten::mm``), else ``other``."""
    return next((name for name, pattern in _COMPILED if pattern.search(operator)), "other")


def profile_steps(step: Callable[[], None], steps: int, top: int = 8) -> dict[str, Any]:
    """Profile ``steps`` calls of ``step`` on the CPU and return, per step: ``ms`` (the operators' self
    time), ``operators`` (operator calls), ``categories`` (``{category: {"ms", "calls"}}``) and ``top`` (the
    ``top`` operators by self time: ``{"op", "ms", "calls"}``); ``ValueError`` naming ``steps`` below 1."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            step()
    events = list(profiler.key_averages())
    categories: dict[str, dict[str, float]] = {}
    for event in events:
        total = categories.setdefault(category_of(event.key), {"ms": 0.0, "calls": 0.0})
        total["ms"] += event.self_cpu_time_total / 1e3 / steps
        total["calls"] += event.count / steps
    ranked = sorted(events, key=lambda event: event.self_cpu_time_total, reverse=True)[:top]
    return {
        "ms": sum(entry["ms"] for entry in categories.values()),
        "operators": sum(event.count for event in events if event.key.startswith("aten::")) / steps,
        "categories": categories,
        "top": [
            {"op": event.key, "ms": event.self_cpu_time_total / 1e3 / steps, "calls": event.count / steps}
            for event in ranked
        ],
    }
