"""Forward+backward time of the compressed layers for each memory layout of their input and upstream gradient
(:data:`LAYOUTS`, one change from ``contiguous`` at a time), part of ``comera bench layers --layouts``.
Details: docs/benchmarks.md, "Linear layers and the tied head: input and gradient layouts"."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from comera.measure import backward_step, interleaved_medians_ms
from comera.nn.embedding import TTMEmbedding
from comera.nn.linear import TTLinear, TTMLinear
from comera.nn.tied_head import TTMTiedHead

__all__ = [
    "LAYOUTS",
    "SEQUENCE_LENGTH",
    "TARGET_VS_CONTIGUOUS",
    "layout_tensors",
    "run_layouts",
    "format_layouts",
    "layout_checks",
]

LAYOUTS = (
    "contiguous",
    "input transposed",
    "input broadcast",
    "gradient transposed",
    "gradient broadcast",
    "sequence-first",
)
SEQUENCE_LENGTH = 128
TARGET_VS_CONTIGUOUS = 1.2


def _tensor(lead: tuple[int, int], width: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """A ``(*lead, width)`` tensor, ``contiguous``, ``transposed`` (sequence-first storage) or
    ``broadcast``."""
    sequences, steps = lead
    if kind == "transposed":
        return torch.randn(steps, sequences, width, generator=generator).transpose(0, 1)
    if kind == "broadcast":
        return torch.randn(1, steps, width, generator=generator).expand(sequences, steps, width)
    return torch.randn(sequences, steps, width, generator=generator)


def layout_tensors(
    batch: int, in_features: int, out_features: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Input ``(B / T, T, in_features)`` (requiring grad) and upstream gradient ``(B / T, T, out_features)``
    of ``layout``; the gradient is None for ``gradient broadcast`` (the step calls ``out.sum().backward()``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    steps = SEQUENCE_LENGTH if batch % SEQUENCE_LENGTH == 0 else 1
    lead = (batch // steps, steps)
    generator = torch.Generator().manual_seed(0)
    input_kind = {"input transposed": "transposed", "input broadcast": "broadcast"}.get(layout, "contiguous")
    if layout == "sequence-first":
        input_kind = "transposed"
    x = _tensor(lead, in_features, input_kind, generator).requires_grad_()
    if layout == "gradient broadcast":
        return x, None
    grad_kind = "transposed" if layout in ("gradient transposed", "sequence-first") else "contiguous"
    return x, _tensor(lead, out_features, grad_kind, generator)


def _time_layouts(
    name: str, layer: nn.Module, batch: int, sizes: tuple[int, int], layouts: Sequence[str], repeats: int
) -> dict:
    steps = {layout: backward_step(layer, *layout_tensors(batch, *sizes, layout)) for layout in layouts}
    return {"layer": name, "batch": batch, **interleaved_medians_ms(steps, repeats)}


def _tied_head() -> TTMTiedHead:
    embedding = TTMEmbedding(30522, 768, row_shape=(16, 20, 10, 10), col_shape=(4, 4, 8, 6), rank=32)
    return TTMTiedHead(embedding)


def run_layouts(
    shapes: Sequence[tuple[int, int]],
    batches: Sequence[int],
    ranks: Sequence[int],
    repeats: int,
    layouts: Sequence[str] = LAYOUTS,
    tied_head: bool = True,
) -> list[dict]:
    """One row per layer and batch: ``layer``, ``batch`` and the milliseconds of each layout."""
    rows = []
    for batch in batches:
        for m, n in shapes:
            layers = {f"nn.Linear {m}->{n}": nn.Linear(m, n)}
            for rank in ranks:
                layers[f"TTLinear {m}->{n} r={rank}"] = TTLinear(m, n, rank=rank)
                layers[f"TTMLinear {m}->{n} r={rank}"] = TTMLinear(m, n, rank=rank)
            for name, layer in layers.items():
                rows.append(_time_layouts(name, layer, batch, (m, n), layouts, repeats))
                print(format_layouts(rows[-1:], layouts, header=False), flush=True)
        if tied_head:
            rows.append(
                _time_layouts(
                    "TTMTiedHead 768->30522 r=32", _tied_head(), batch, (768, 30522), layouts, repeats
                )
            )
            print(format_layouts(rows[-1:], layouts, header=False), flush=True)
    return rows


def format_layouts(rows: list[dict], layouts: Sequence[str], header: bool = True) -> str:
    """Markdown table: each layout's milliseconds and, in parentheses, its ratio to ``contiguous``."""
    lines = []
    if header:
        lines += [
            "| layer | B | " + " | ".join(f"{layout} ms" for layout in layouts) + " | slowest / contiguous |",
            "|---|---|" + "---|" * (len(layouts) + 1),
        ]
    for row in rows:
        base = row.get("contiguous")
        cells = [
            f"{row[layout]:.2f}" + (f" ({row[layout] / base:.2f})" if base else "") for layout in layouts
        ]
        worst = f"{max(row[layout] for layout in layouts) / base:.2f}x" if base else "n/a"
        lines.append(f"| {row['layer']} | {row['batch']} | " + " | ".join(cells) + f" | {worst} |")
    return "\n".join(lines)


def layout_checks(rows: list[dict], layouts: Sequence[str]) -> str:
    """Markdown lines: the compressed layers whose slowest layout is more than 1.2x their contiguous time."""
    compressed = [row for row in rows if not row["layer"].startswith("nn.Linear") and row.get("contiguous")]
    behind = [
        row
        for row in compressed
        if max(row[layout] for layout in layouts) > TARGET_VS_CONTIGUOUS * row["contiguous"]
    ]
    lines = [
        f"Layouts: {len(compressed) - len(behind)} of {len(compressed)} compressed layers have every layout "
        f"within {TARGET_VS_CONTIGUOUS:g}x of their contiguous time."
    ]
    for row in behind:
        worst = max(layouts, key=lambda layout: row[layout])
        lines.append(f"- {row['layer']}, B={row['batch']}: {worst} {row[worst] / row['contiguous']:.2f}x")
    return "\n".join(lines)
