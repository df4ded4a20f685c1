"""``comera prepare llm|mlm --data PATH --out DIR``: tokenize a corpus once into memory-mapped token shards
that ``comera train llm|mlm --data DIR`` reads (:func:`comera.data.prepare.prepare_corpus`), on every core,
with the ``data`` settings ``comera train`` resolves; run again, it continues a stopped preparation.
Details: docs/llm.md, 'Bringing a corpus'.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from comera.cli.commands.config_file import config_argument
from comera.cli.commands.paths import path_argument
from comera.data.corpus_sample import DEFAULT_SAMPLE_MB
from comera.data.prepare import DEFAULT_SHARD_TOKENS, PrepareSettings, PrepareSummary, prepare_corpus
from comera.data.progress import Progress
from comera.recipes.settings import add_set_argument
from comera.recipes.spec import run_spec
from comera.workloads import load_recipe
from comera.workloads.mlm.prepared import MLM_TEXT_FIELDS

__all__ = ["main", "summary"]

WORKLOADS = ("llm", "mlm")
"""The workloads whose corpus can be prepared."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comera prepare",
        description="Tokenize a corpus once into token shards and index.json, for comera train WORKLOAD "
        "--data DIR.",
    )
    parser.add_argument("workload", choices=WORKLOADS, help="the workload whose tokenizer and split to use")
    parser.add_argument(
        "--data",
        required=True,
        type=path_argument,
        help="a corpus file or folder: .txt (a document each), .jsonl / .jsonl.gz (a 'text' field a line), "
        ".parquet (a 'text' column; needs pyarrow), or a folder written by datasets.save_to_disk (needs "
        "pyarrow)",
    )
    parser.add_argument("--out", required=True, type=path_argument, help="the prepared corpus's folder")
    parser.add_argument(
        "--preset", default="small", help="the preset whose data settings apply (default: small)"
    )
    parser.add_argument("--config", default=None, type=config_argument, help="TOML file of settings ([data])")
    add_set_argument(parser, "override one setting, e.g. data.vocab_size=8192 (repeatable)")
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"tokens a shard reaches before it is closed (default {DEFAULT_SHARD_TOKENS:,})",
    )
    parser.add_argument(
        "--sample-mb",
        type=float,
        default=DEFAULT_SAMPLE_MB,
        metavar="MB",
        help=f"MB of training text the tokenizer is trained on, drawn across all files (default "
        f"{DEFAULT_SAMPLE_MB})",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="tokenizing processes (default: one per core; 0: tokenize in this process)",
    )
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=None,
        help="one line per phase instead of progress bars, even on a terminal",
    )
    return parser


def _print_line(line: str) -> None:
    print(f"  {line}", flush=True)


def summary(result: PrepareSummary, out: str) -> str:
    """A few lines about a finished preparation: per split documents, tokens and shards; skipped records;
    the shards written, kept and redone; the time."""
    index = result.index
    vocabulary = index["tokenizer"]["vocab_size"]
    lines = [f"prepared corpus: {out} ({index['dtype']} ids, vocabulary {vocabulary:,})"]
    for split, facts in index["splits"].items():
        lines.append(
            f"  {split}: {facts['documents']:,} documents, {facts['tokens']:,} tokens in "
            f"{len(facts['shards'])} shards"
        )
    skipped = index["skipped"]
    if skipped["total"]:
        by_reason = skipped["by_reason"].items()
        reasons = ", ".join(f"{count:,} {reason.replace('_', ' ')}" for reason, count in by_reason)
        lines.append(f"  skipped: {reasons} (the first {len(skipped['first'])} named in index.json)")
    lines.append(
        f"  shards written {len(result.written)}, kept {len(result.kept)}, redone {len(result.redone)}; "
        f"{result.seconds:.1f} s"
    )
    return "\n".join(lines)


def _documents(workload: str, data: dict) -> dict[str, Any]:
    """What the workload reads as documents: ``.txt`` files and C4's ``text`` field for ``llm``; the files
    ending in ``data.extensions`` (``.py``) and CodeSearchNet's ``code`` field (else ``text``) for ``mlm``."""
    if workload == "mlm":
        return {
            "whole_files": tuple(data.get("extensions", (".py",))),
            "text_fields": MLM_TEXT_FIELDS,
            "needs_mask": True,
        }
    return {}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera prepare``."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        presets = load_recipe(args.workload).presets
        if args.preset not in presets:
            raise ValueError(f"unknown --preset {args.preset!r}; choose one of {sorted(presets)}")
        if args.sample_mb <= 0:
            raise ValueError(f"--sample-mb must be a number > 0, got {args.sample_mb!r}")
        data = run_spec(
            args.workload, "dense", args.preset, config_file=args.config, assignments=args.assignments
        ).settings["data"]
        settings = PrepareSettings(
            vocab_size=data["vocab_size"],
            validation_fraction=data["validation_fraction"],
            tokenizer_file=data.get("tokenizer_file"),
            skip_bad_lines=data.get("skip_bad_lines", False),
            shard_tokens=args.shard_tokens,
            sample_bytes=max(1, round(args.sample_mb * 10**6)),
            **_documents(args.workload, data),
        )
        if args.workers is not None and args.workers < 0:
            raise ValueError(f"--workers must be an int >= 0, got {args.workers}")
        progress = Progress(bar=args.progress, write=_print_line)
        result = prepare_corpus(args.data, args.out, settings, workers=args.workers, progress=progress)
    except (ValueError, FileNotFoundError, ImportError) as error:
        print(f"comera prepare: {error}", file=sys.stderr)
        return 2
    print(summary(result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
