"""Training throughput in one and in several processes: ``comera bench scaling``.
Each case is one shortened ``comera train`` run (``torchrun`` for ``--nproc`` > 1), step time from its
``results.json`` (for several processes the slowest rank's median), throughput = global batch / step time.
Details: docs/benchmarks.md, "Processes: samples/s at 1 and 2 processes".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from comera.measure import machine_description, markdown_file_argument, update_section

__all__ = ["main", "run_case", "format_report"]

WORKLOADS = ("nli", "dlrm", "mlm", "llm")


def run_case(
    workload: str, processes: int, *, preset: str, method: str, steps: int, cache: Path, out: Path
) -> dict[str, Any]:
    """One shortened training run in ``processes`` processes; its batch, step time and throughput.

    Raises:
        RuntimeError: the run failed (its last output lines are in the message).
    """
    command = [sys.executable, "-m", "comera", "train", workload, "--preset", preset, "--method", method]
    if processes > 1:
        command += ["--nproc", str(processes)]
    for assignment in (f"train.early={steps}", "train.late=0", "train.unit=step", "train.log_every=5"):
        command += ["--set", assignment]
    command += ["--cache", str(cache), "--out", str(out), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "COMERA_AUTOTUNE": "0"})
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command)} failed with status {done.returncode}:\n{tail}")
    results = json.loads((out / "results.json").read_text())
    config = json.loads((out / "config.json").read_text())
    batch = int(config["settings"]["train"]["batch_size"])
    per_rank = results.get("step_time_s_per_rank") or [results["step_time_s"]]
    step = max(per_rank)
    return {
        "workload": workload,
        "processes": processes,
        "threads": os.environ.get("OMP_NUM_THREADS", "1" if processes > 1 else "default"),
        "batch": batch,
        "step_ms": step * 1000,
        "samples_per_s": batch / step,
    }


def format_report(cases: list[dict[str, Any]], command: str) -> str:
    """The markdown section: machine, command, one row per case, speed-up over one process."""
    single = {case["workload"]: case["samples_per_s"] for case in cases if case["processes"] == 1}
    lines = [
        f"Machine: {machine_description()}. Command: `{command}`. Shortened runs of each workload's preset "
        "(early stage only); step time = the slowest rank's median; throughput = global batch / step time.",
        "",
        "| workload | processes | threads per process | global batch | step ms | samples/s | vs 1 process |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        base = single.get(case["workload"])
        speedup = f"{case['samples_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {case['workload']} | {case['processes']} | {case['threads']} | {case['batch']} | "
            f"{case['step_ms']:.1f} | {case['samples_per_s']:.1f} | {speedup} |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="comera bench scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2], help="process counts (>= 1)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--method", default="comera")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (>= 10)")
    parser.add_argument(
        "--write", type=markdown_file_argument, help="markdown file to update (section 'scaling')"
    )
    parser.add_argument("--json", type=Path, help="write the cases as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera bench scaling``."""
    args = _parser().parse_args(argv)
    if any(count < 1 for count in args.processes):
        print(f"comera bench scaling: --processes must be >= 1, got {args.processes}", file=sys.stderr)
        return 2
    if args.steps < 10:
        print(f"comera bench scaling: --steps must be >= 10, got {args.steps}", file=sys.stderr)
        return 2
    cases = []
    with tempfile.TemporaryDirectory(prefix="comera-scaling-") as folder:
        root = Path(folder)
        for workload in args.workloads:
            for processes in args.processes:
                out = root / f"{workload}-{processes}"
                case = run_case(
                    workload,
                    processes,
                    preset=args.preset,
                    method=args.method,
                    steps=args.steps,
                    cache=root / "cache",
                    out=out,
                )
                print(json.dumps(case), flush=True)
                cases.append(case)
    command = "comera bench scaling " + " ".join(sys.argv[1:] if argv is None else argv)
    report = format_report(cases, command.strip())
    print(report)
    if args.json is not None:
        args.json.write_text(json.dumps(cases, indent=2) + "\n")
    if args.write is not None:
        update_section(args.write, "scaling", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
