"""GPU benchmark on one CUDA device: TT layers against dense (fp32, bf16 autocast, ``--fp8``; eager and as a
replayed CUDA graph), and the whole-step CUDA graph against eager Trainer steps. Needs CUDA (exit status 2
without). Details: docs/benchmarks.md, "GPU: layers and the whole-step CUDA graph"."""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from comera.bench.trainer import BATCH, CLASSES, SEQ, VOCAB, make_model
from comera.measure import machine_description, markdown_file_argument, update_section
from comera.methods.comera import CoMERAObjective, CoMERASettings
from comera.nn.linear import TTLinear
from comera.train import TrainConfig, Trainer
from comera.tt.fp8 import fp8_supported

SHAPES = ((768, 768), (768, 3072), (3072, 768))
"""``(in_features, out_features)`` of the paper transformer's projections."""
TOKENS = (4096, 32768)
"""Rows per call: a batch of 32 x 128 tokens, and of 256 x 128."""
RANK = 16


def cuda_ms(call: Callable[[], None], calls: int) -> float:
    """Milliseconds per call of ``call``, timed with CUDA events over ``calls`` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def training_call(layer: nn.Module, x: torch.Tensor, bf16: bool) -> Callable[[], None]:
    """One forward and backward of ``layer`` on ``x`` (gradients set to None first; autocast without its
    weight cache, as graph capture requires)."""

    def call() -> None:
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=bf16, cache_enabled=False):
            out = layer(x)
        out.float().square().mean().backward()

    return call


class Replay:
    """A call captured as a CUDA graph after three warm-up calls on a side stream; calling it replays it (the
    GPU's own time, no Python or launch cost). It keeps the call and every tensor the graph reads and writes
    alive, as a graph only records addresses."""

    def __init__(self, call: Callable[[], None]) -> None:
        self.call = call
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            call()

    def __call__(self) -> None:
        self.graph.replay()


def peak_call_mib(call: Callable[[], None]) -> float:
    """Peak CUDA memory of one call over what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def layer_rows(repeats: int, calls: int, fp8: bool) -> list[dict]:
    """One row per shape, token count and precision: ms per call and peak MiB of each layer kind."""
    device = torch.device("cuda")
    rows = []
    for fan_in, fan_out in SHAPES:
        for tokens in TOKENS:
            for bf16 in (False, True):
                torch.manual_seed(0)
                x = torch.randn(tokens, fan_in, device=device, requires_grad=True)
                layers = {
                    "dense": nn.Linear(fan_in, fan_out).to(device),
                    "tt": TTLinear(fan_in, fan_out, rank=RANK).to(device),
                }
                if fp8 and bf16 and fp8_supported(device):
                    layers["tt_fp8"] = TTLinear(fan_in, fan_out, rank=RANK, gemm="fp8").to(device)
                work = {name: training_call(layer, x, bf16) for name, layer in layers.items()}
                replayed = x.detach().clone().requires_grad_()
                for name in ("dense", "tt"):
                    twin = copy.deepcopy(layers[name])
                    work[f"{name}_graph"] = Replay(training_call(twin, replayed, bf16))
                for call in work.values():
                    for _ in range(3):
                        call()
                samples: dict[str, list[float]] = {name: [] for name in work}
                for _ in range(repeats):
                    for name, call in work.items():
                        samples[name].append(cuda_ms(call, calls))
                row = {
                    "in": fan_in,
                    "out": fan_out,
                    "tokens": tokens,
                    "precision": "bf16" if bf16 else "fp32",
                }
                for name, call in work.items():
                    row[f"{name}_ms"] = statistics.median(samples[name])
                    if not name.endswith("_graph"):  # a replay allocates nothing: its pool is reserved
                        row[f"{name}_mib"] = peak_call_mib(call)
                rows.append(row)
    return rows


def step_ms(steps: int, batch: int, cuda_graph: bool, warmup: int = 5) -> dict[str, float]:
    """Median ms per Trainer step (after ``warmup`` steps) of the small TT transformer on CUDA, and the peak
    CUDA memory of the whole run over what was allocated before the model was built."""
    generator = torch.Generator().manual_seed(1)
    total = warmup + steps
    ids = torch.randint(VOCAB, (total, batch, SEQ), generator=generator)
    labels = torch.randint(CLASSES, (total, batch), generator=generator)

    def loss_fn(model: nn.Module, pair) -> torch.Tensor:
        tokens, targets = pair
        return nn.functional.cross_entropy(model(tokens.cuda()), targets.cuda())

    stamps: list[float] = []

    def stamp(_trainer: Trainer) -> None:
        torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = make_model().cuda()
    settings = CoMERASettings(prune_at=())
    config = TrainConfig(early=total, unit="step", progress=False, cuda_graph=cuda_graph, log_every=total)
    trainer = Trainer(
        model,
        loss_fn,
        list(zip(ids, labels)),
        config=config,
        objective=CoMERAObjective(model, settings),
        callbacks=[stamp],
    )
    trainer.fit()
    intervals = [later - earlier for earlier, later in zip(stamps[warmup:], stamps[warmup + 1 :])]
    return {
        "step_ms": 1e3 * statistics.median(intervals),
        "peak_mib": (torch.cuda.max_memory_allocated() - before) / 2**20,
    }


def layer_table(rows: list[dict]) -> str:
    """Markdown: one line per row; eager and graph-replayed times, their dense / TT ratios, peak memory."""
    has_fp8 = any("tt_fp8_ms" in row for row in rows)
    head = (
        "| in x out | tokens | precision | dense ms | TT ms | dense / TT | dense graph ms | TT graph ms | "
        "dense / TT, graphs | dense MiB | TT MiB |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|---|---|"
    if has_fp8:
        head += " TT fp8 ms |"
        rule += "---|"
    lines = [head, rule]
    for row in rows:
        line = (
            f"| {row['in']} x {row['out']} | {row['tokens']} | {row['precision']} | {row['dense_ms']:.3f} | "
            f"{row['tt_ms']:.3f} | {row['dense_ms'] / row['tt_ms']:.2f}x | {row['dense_graph_ms']:.3f} | "
            f"{row['tt_graph_ms']:.3f} | {row['dense_graph_ms'] / row['tt_graph_ms']:.2f}x | "
            f"{row['dense_mib']:.0f} | {row['tt_mib']:.0f} |"
        )
        if has_fp8:
            line += f" {row['tt_fp8_ms']:.3f} |" if "tt_fp8_ms" in row else " - |"
        lines.append(line)
    return "\n".join(lines)


def step_table(eager: dict[str, float], graph: dict[str, float]) -> str:
    """Markdown: eager and CUDA-graph step time and peak memory."""
    return "\n".join(
        [
            "| step | ms / step (median) | peak MiB |",
            "|---|---|---|",
            f"| eager | {eager['step_ms']:.2f} | {eager['peak_mib']:.0f} |",
            f"| CUDA graph (`cuda_graph=True`) | {graph['step_ms']:.2f} | {graph['peak_mib']:.0f} |",
            "",
            f"Eager / graph step time: {eager['step_ms'] / graph['step_ms']:.2f}x.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="comera bench gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=9, help="timed samples per layer case (median)")
    parser.add_argument("--calls", type=int, default=20, help="calls per timed sample")
    parser.add_argument("--steps", type=int, default=50, help="timed Trainer steps per mode")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"Trainer batch (sequences of {SEQ} tokens)")
    parser.add_argument("--fp8", action="store_true", help="also time TTLinear(gemm='fp8') under bf16")
    parser.add_argument("--json", metavar="PATH", help="write the measurements as JSON")
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        metavar="MARKDOWN",
        help="update the 'gpu' section of this file",
    )
    args = parser.parse_args(argv)
    for name in ("repeats", "calls", "steps", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        print("comera bench gpu: needs a CUDA device, and torch sees none here", flush=True)
        return 2
    print(machine_description(), flush=True)
    rows = layer_rows(args.repeats, args.calls, args.fp8)
    layers = layer_table(rows)
    print(layers, flush=True)
    eager, graph = step_ms(args.steps, args.batch, False), step_ms(args.steps, args.batch, True)
    steps = step_table(eager, graph)
    print(steps, flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"machine": machine_description(), "layers": rows, "eager": eager, "graph": graph}, handle
            )
    if args.write:
        command = f"comera bench gpu --repeats {args.repeats} --calls {args.calls} --steps {args.steps}"
        command += f" --batch {args.batch}" + (" --fp8" if args.fp8 else "")
        body = (
            "## GPU: layers and the whole-step CUDA graph\n\n"
            f"Machine: {machine_description()}. Command: `{command}`. Layers: forward + backward "
            f"(`TTLinear` rank {RANK}, order `auto`), CUDA-event time per call, median of {args.repeats} "
            f"samples of {args.calls} calls, cases round-robin in one process; MiB = peak CUDA memory of one "
            "call over what was allocated before it.\n\n"
            f"{layers}\n\nTraining step: the Trainer on the small TT transformer of `comera bench trainer` "
            f"(batch {args.batch} x {SEQ}), median of {args.steps} steps after 5 warm-up steps.\n\n{steps}\n"
        )
        update_section(args.write, "gpu", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
