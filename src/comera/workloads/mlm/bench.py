"""Masked-LM pre-training step benchmark: time and memory of one step, dense against comera.
Run as ``comera bench mlm``: forward, masked-LM loss on the masked positions, backward and AdamW of the
RoBERTa masked LM of ``--preset``, each method (and each ``--ranks`` rung) in a fresh process; ``--write``
replaces a section of a markdown file. Details: docs/benchmarks.md, 'Masked-LM pre-training step'.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from comera.cpu import reuse_freed_memory
from comera.data.bpe import SpecialIds
from comera.measure import (
    add_memory_argument,
    allocation_of,
    fmt,
    machine_description,
    markdown_file_argument,
    median_ms,
    peak_rise_mib,
    ratio,
    status_mib,
    update_section,
)
from comera.rank import RankAdaptation, param_groups
from comera.report import compression_report
from comera.tensorize import tensorize_
from comera.workloads.mlm.masking import MaskingCollator
from comera.workloads.mlm.model import MODEL_PRESETS, build_mlm_model
from comera.workloads.mlm.packing import pack_documents
from comera.workloads.mlm.presets import TENSORIZE_PRESETS

__all__ = ["METHODS", "VOCAB", "make_batch", "build_step", "run_case", "run_cases", "format_report", "main"]

METHODS = ("dense", "comera")
VOCAB = 50265
"""The default vocabulary size: RoBERTa's and CodeBERT's."""
# learning rates of the paper's MNLI run (paper-notes 10.3); the step's cost does not depend on them
_LR_DENSE = 1e-4
_LR_GROUPS = {"lr_cores": 1e-4, "lr_gates": 1e-3, "lr_other": 5e-5}


def make_batch(batch: int, seq_len: int, vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A pre-training batch: ``batch`` full blocks of random ordinary tokens with ``</s>`` between documents,
    masked by :class:`MaskingCollator`. Returns ``input_ids``, ``attention_mask``, ``labels``, each
    ``(batch, seq_len)``."""
    ids = SpecialIds(bos=0, pad=1, eos=2, unk=3, mask=4, vocab_size=vocab_size)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, vocab_size, (batch * (seq_len - 1),), generator=generator)
    documents = [chunk.tolist() for chunk in tokens.split(97)]
    blocks = pack_documents(documents, seq_len, ids, tail="drop")
    return MaskingCollator(ids, seed=seed)([blocks[i] for i in range(min(batch, len(blocks)))])


def build_step(preset: str, method: str, vocab_size: int, rank: int | None = None):
    """The model and a function running one training step on a batch (dict of tensors); ``rank`` (comera
    only) replaces the preset's max rank of the tensorized linears (the embedding keeps its own)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    model = build_mlm_model(preset, vocab_size, dropout=0.1).train()
    if method == "dense":
        optimizer = torch.optim.AdamW(model.parameters(), lr=_LR_DENSE, weight_decay=0.0, fused=True)
        rank = None
    else:
        overrides = {} if rank is None else {"rank": rank}
        tensorize_(model, TENSORIZE_PRESETS[f"mlm-{preset}"].with_overrides(**overrides))
        optimizer = torch.optim.AdamW(param_groups(model, **_LR_GROUPS), fused=True)
        rank = RankAdaptation(model)

    def step(batch: dict[str, torch.Tensor]) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch, masked_only=True).loss
        (loss if rank is None else rank.loss(loss)).backward()
        optimizer.step()

    return model, step


def run_case(
    preset: str,
    method: str,
    batch: int,
    seq_len: int,
    vocab_size: int,
    repeats: int,
    memory: str = "reuse",
    rank: int | None = None,
) -> dict:
    """Peak memory of one step and median time of ``repeats`` steps, in this process."""
    torch.manual_seed(0)
    model, step = build_step(preset, method, vocab_size, rank)
    inputs = make_batch(batch, seq_len, vocab_size)
    step(make_batch(1, 16, vocab_size, seed=1))  # loads code, starts threads, creates the optimizer state
    start = time.perf_counter()
    peak = peak_rise_mib(lambda: step(inputs))
    first = time.perf_counter() - start
    repeats = max(1, min(repeats, int(120.0 / max(first, 1e-3))))
    if memory == "reuse":
        reuse_freed_memory()
    report = compression_report(model)
    return {
        "preset": preset,
        "method": method,
        "rank": None if method == "dense" else (rank or TENSORIZE_PRESETS[f"mlm-{preset}"].rank),
        "batch": batch,
        "seq_len": seq_len,
        "vocab_size": vocab_size,
        "ms": median_ms(lambda: step(inputs), repeats=repeats, warmup=1),
        "repeats": repeats,
        "memory": memory,
        "step_peak_mb": peak,
        "process_peak_mb": status_mib("VmHWM"),
        "parameters": report.model_params,
        "dense_parameters": report.model_dense_params,
    }


def _run_in_fresh_process(case: str, repeats: int, threads: int | None, case_args: list[str]) -> dict:
    command = [
        sys.executable,
        "-m",
        "comera.workloads.mlm.bench",
        "--case",
        case,
        "--repeats",
        str(repeats),
        *case_args,
    ]
    if threads is not None:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cases(
    preset: str,
    methods: Sequence[str],
    *,
    batch: int,
    seq_len: int,
    vocab_size: int,
    repeats: int,
    threads: int | None = None,
    memory: str = "reuse",
    ranks: Sequence[int] = (),
) -> list[dict]:
    """Every method's case, then comera at each of ``ranks`` (the tensorized linears' max rank), each in a
    fresh process, with a progress line per case; ``RuntimeError`` with the end of its stderr when one
    fails."""
    case_args = ["--preset", preset, "--batch", str(batch), "--seq-len", str(seq_len)]
    case_args += ["--vocab", str(vocab_size), "--memory", memory]
    cases = [(method, []) for method in methods] + [("comera", ["--rank", str(rank)]) for rank in ranks]
    results = []
    for method, extra in cases:
        result = _run_in_fresh_process(method, repeats, threads, case_args + extra)
        results.append(result)
        print(
            f"{_label(result):18s} {result['ms']:10.1f} ms {fmt(result['step_peak_mb']):>9s} MiB step "
            f"{fmt(result['process_peak_mb']):>9s} MiB process",
            flush=True,
        )
    return results


def _label(result: dict) -> str:
    return result["method"] if result.get("rank") is None else f"{result['method']} (rank {result['rank']})"


def format_report(results: list[dict], command: str) -> str:
    """A markdown table of the cases, with dense/comera ratios of time and memory."""
    first = results[0]
    lines = [
        "## Masked-LM pre-training step (forward, loss, backward, AdamW)",
        "",
        f"Preset `{first['preset']}`, batch {first['batch']} x "
        f"{first['seq_len']} tokens, vocabulary {first['vocab_size']}; LM head on the masked positions only; "
        f"timed steps' allocation: {allocation_of(results)}; `{command}`.",
        f"Machine: {machine_description()}.",
        "",
        "| method | linears' max rank | parameters | compression | step ms (median) | step peak rise MiB "
        "| process peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        lines.append(
            f"| {result['method']} | {result.get('rank') or '-'} | {result['parameters']:,} | "
            f"{ratio(result['dense_parameters'], result['parameters'], 2)} | {fmt(result['ms'])} | "
            f"{fmt(result['step_peak_mb'])} | {fmt(result['process_peak_mb'])} |"
        )
    dense = next((result for result in results if result["method"] == "dense"), None)
    compressed = [result for result in results if result["method"] != "dense"]
    if dense is not None and compressed:
        lines.append("")
        for result in compressed:
            lines.append(
                f"dense / {_label(result)}: step time {ratio(dense['ms'], result['ms'], 2)}, step peak rise "
                f"{ratio(dense['step_peak_mb'], result['step_peak_mb'], 2)}, process peak "
                f"{ratio(dense['process_peak_mb'], result['process_peak_mb'], 2)}."
            )
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="comera bench mlm", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--batch", type=int, default=4, help="blocks per step (default 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per block (default: the preset's)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary size (default {VOCAB})")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per method (default 3)")
    parser.add_argument(
        "--ranks",
        nargs="+",
        type=int,
        default=[],
        help="also run comera with the tensorized linears' max rank set to each of these (a rank ladder)",
    )
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per case (default: torch's)")
    add_memory_argument(parser)
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        default=None,
        help="markdown file whose section (--section) is replaced",
    )
    parser.add_argument("--section", default="mlm", help="name of the section --write replaces")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("batch", "vocab", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for rank in [*args.ranks, *([] if args.rank is None else [args.rank])]:
        if rank < 1:
            parser.error(f"--ranks must be >= 1, got {rank}")
    if args.seq_len is not None and not 2 <= args.seq_len <= MODEL_PRESETS[args.preset]["max_length"]:
        parser.error(
            f"--seq-len must be in [2, {MODEL_PRESETS[args.preset]['max_length']}], got {args.seq_len}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (each method in a fresh process), print the table, optionally write it."""
    args = _parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    seq_len = args.seq_len or MODEL_PRESETS[args.preset]["max_length"]
    if args.case is not None:
        method = args.case
        result = run_case(
            args.preset, method, args.batch, seq_len, args.vocab, args.repeats, args.memory, args.rank
        )
        print(json.dumps(result))
        return 0
    results = run_cases(
        args.preset,
        args.methods,
        batch=args.batch,
        seq_len=seq_len,
        vocab_size=args.vocab,
        repeats=args.repeats,
        threads=args.threads,
        memory=args.memory,
        ranks=args.ranks,
    )
    command = "comera bench mlm " + " ".join(argv if argv is not None else sys.argv[1:])
    report = format_report(results, command.strip())
    print(report)
    if args.write:
        update_section(args.write, args.section, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
