"""``comera bench attention``: one attention layer's forward and backward, CPU training paths side by side.
Variants ``blocked``, ``explicit``, ``sdpa-dropout`` and ``sdpa-no-dropout`` (a floor, not the same
computation) on ``B x H x T x d`` shapes, medians in one process, peak memory in fresh processes. Details:
docs/benchmarks.md, "Attention layer with dropout" and "How the benchmarks measure".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from comera.cpu import reuse_freed_memory
from comera.measure import (
    add_memory_argument,
    allocation_of,
    interleaved_medians_ms,
    machine_description,
    markdown_file_argument,
    peak_rise_mib,
    update_section,
)
from comera.models.attention import attention_context, plain_dropout_attention

__all__ = ["VARIANTS", "parse_shape", "make_inputs", "make_step", "run_shape", "format_report", "main"]

VARIANTS = ("blocked", "explicit", "sdpa-dropout", "sdpa-no-dropout")
DEFAULT_SHAPES = ("32x12x128x64", "4x12x512x64")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"BxHxTxd"`` -> ``(B, H, T, d)``, each a positive integer."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(
            f"shape must be BxHxTxd with four positive integers (e.g. 32x12x128x64), got {text!r}"
        )
    batch, heads, length, width = (int(part) for part in parts)
    return batch, heads, length, width


def _attend(variant: str, p: float) -> Callable:
    if variant == "blocked":
        return lambda q, k, v, bias: attention_context(q, k, v, bias, p)
    if variant == "explicit":
        return lambda q, k, v, bias: plain_dropout_attention(q, k, v, bias, p, q.shape[-1] ** -0.5)
    if variant == "sdpa-dropout":
        return lambda q, k, v, bias: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)
    if variant == "sdpa-no-dropout":
        return lambda q, k, v, bias: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")


def make_inputs(shape: tuple[int, int, int, int], padding: bool) -> dict[str, torch.Tensor | None]:
    """Seeded ``q``, ``k``, ``v`` (head-split views of ``(B, T, H, d)`` leaves), the context's gradient
    ``grad`` ``(B, T, H * d)`` and ``bias`` (``(B, 1, 1, T)`` with the last quarter of the keys of the second
    half of the batch masked, or None)."""
    batch, heads, length, width = shape
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, length, heads, width, generator=generator).transpose(1, 2).requires_grad_()
        for _ in range(3)
    )
    bias = None
    if padding:
        bias = torch.zeros(batch, 1, 1, length)
        bias[batch // 2 :, ..., length - length // 4 :] = float("-inf")
    grad = torch.randn(batch, length, heads * width, generator=generator)
    return {"q": q, "k": k, "v": v, "bias": bias, "grad": grad}


def make_step(inputs: dict[str, torch.Tensor | None], variant: str, p: float) -> Callable[[], None]:
    """One forward and backward of ``variant`` on :func:`make_inputs`' tensors; the step leaves the
    gradients of q, k and v in their ``.grad``."""
    q, k, v, bias, grad = (inputs[name] for name in ("q", "k", "v", "bias", "grad"))
    batch, heads, length, width = q.shape
    attend = _attend(variant, p)

    def step() -> None:
        q.grad = k.grad = v.grad = None
        context = attend(q, k, v, bias).transpose(1, 2).reshape(batch, length, heads * width)
        context.backward(grad)

    return step


def run_shape(
    shape: tuple[int, int, int, int], variants: Sequence[str], p: float, padding: bool, repeats: int
) -> dict[str, float]:
    """Median milliseconds per variant, in this process, timed round-robin."""
    steps = {variant: make_step(make_inputs(shape, padding), variant, p) for variant in variants}
    return interleaved_medians_ms(steps, repeats=repeats)


def _memory_case(shape: tuple[int, int, int, int], variant: str, p: float, padding: bool) -> float:
    """Resident-set rise of one step of ``shape``, after one 1 x 1 x 8 x 8 step loaded code and threads."""
    make_step(make_inputs((1, 1, 8, 8), padding), variant, p)()
    step = make_step(make_inputs(shape, padding), variant, p)
    return peak_rise_mib(step)


def _fresh_memory(args: argparse.Namespace, shape_text: str, variant: str) -> float:
    command = [sys.executable, "-m", "comera.bench.attention", "--memory-case", f"{shape_text}:{variant}"]
    command += ["--p", str(args.p)] + (["--padding"] if args.padding else [])
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory case {shape_text}:{variant} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def format_report(results: list[dict[str, Any]], command: str) -> str:
    """Markdown: one row per shape and variant, time and its ratio to ``blocked``, peak memory rise."""
    lines = [
        "## Attention layer with dropout: forward + backward, CPU training paths",
        "",
        f"Machine: {machine_description()}. Command: `{command}`. Medians over rounds in one process, "
        f"variants round-robin (allocation: {allocation_of(results)}); memory = resident-set rise during one "
        "forward and backward after a tiny warm-up one, each variant in a fresh process (glibc's default "
        "allocation).",
        "",
        "| shape B x H x T x d | variant | ms | time / blocked | peak rise MiB |",
        "|---|---|---|---|---|",
    ]
    for result in results:
        blocked = result["ms"].get("blocked")
        for variant, ms in result["ms"].items():
            ratio = "-" if blocked is None else f"{ms / blocked:.2f}x"
            memory = result["mib"].get(variant)
            memory_text = "-" if memory is None else f"{memory:.0f}"
            lines.append(f"| {result['shape']} | {variant} | {ms:.1f} | {ratio} | {memory_text} |")
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="comera bench attention", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="BxHxTxd, e.g. 32x12x128x64"
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--p", type=float, default=0.1, help="attention dropout, in (0, 1) (default 0.1)")
    parser.add_argument("--padding", action="store_true", help="add a (B, 1, 1, T) padding bias")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory cases")
    add_memory_argument(parser)
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        default=None,
        help="update the 'attention' section of this markdown file",
    )
    parser.add_argument("--json", default=None, help="also write the raw results to this JSON file")
    parser.add_argument("--memory-case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.parsed_shapes = [parse_shape(text) for text in args.shapes]
    except ValueError as error:
        parser.error(f"--shapes: {error}")
    if not 0.0 < args.p < 1.0:
        parser.error(f"--p must be in (0, 1), got {args.p}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera bench attention``."""
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.memory_case is not None:
        shape_text, variant = args.memory_case.split(":")
        print(_memory_case(parse_shape(shape_text), variant, args.p, args.padding))
        return 0
    if args.memory == "reuse":
        reuse_freed_memory()
    results = []
    for shape_text, shape in zip(args.shapes, args.parsed_shapes, strict=True):
        times = run_shape(shape, args.variants, args.p, args.padding, args.repeats)
        memory = {} if args.no_memory else {v: _fresh_memory(args, shape_text, v) for v in args.variants}
        results.append({"shape": shape_text, "ms": times, "mib": memory, "memory": args.memory})
        print(f"{shape_text}: " + ", ".join(f"{v} {ms:.1f} ms" for v, ms in times.items()), flush=True)
    command = "comera bench attention " + " ".join(argv if argv is not None else sys.argv[1:])
    report = format_report(results, command.strip())
    print(report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"machine": machine_description(), "results": results}, handle, indent=2)
    if args.write:
        update_section(args.write, "attention", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
