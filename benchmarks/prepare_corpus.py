"""Preparing a corpus at scale: ``comera prepare llm`` on a C4-like ``.jsonl.gz`` corpus made on the machine,
its peak memory and throughput against ``tokenizers``' own ``encode_batch`` ceiling, and the start of
``comera train llm --data PREPARED`` against a run on the embedded corpus.

    python benchmarks/prepare_corpus.py --gb 2 --work /tmp/corpus-bench [--write docs/benchmarks.md]
    python benchmarks/prepare_corpus.py --gb 8 --work /tmp/corpus-bench --start-only [--write ...]

Steps (each one's numbers go in the table):

1. **The corpus** (``WORK/corpus-<GB>gb/``, made once and reused): documents of 1 KB to 50 KB
   (log-uniform), each a run of consecutive text from one file of the running Python's standard library
   (sources, ``*.py``) or its documentation topics (``pydoc_data.topics``), starting at a random line,
   drawn with a fixed seed; written as C4's ``{"text": ...}`` lines into ``.jsonl.gz`` files of about 256 MB
   of JSON each, until the JSON lines hold ``--gb`` GB (10**9 bytes). The text repeats (the library is
   31 MB), shuffled.
2. **The preparation**: ``comera prepare llm --data CORPUS --out WORK/prepared-<GB>gb --preset small``
   (a 4096-token BPE trained on the default 100 MB sample, every core), in a fresh process while the
   resident and proportional memory (RSS, PSS) of it and its worker processes are sampled every 0.2 s;
   the peak of their sums is reported. Its phase lines give each phase's time.
3. **The ceiling**: one process per core, each encoding its share of the first ``--ceiling-mb`` MB of the
   corpus's texts with the prepared tokenizer by ``encode_batch`` (and ``encode_batch_fast``, what the
   workers call) in batches of 256 documents on one thread; the rate is all their text bytes over the
   slowest process's time. The preparation's encoding rate is the corpus's text bytes over its encoding
   phase's time.
4. **Training's start**: ``comera train llm --preset small --method dense`` for 3 steps (one record a
   step) on ``--data WORK/prepared-<GB>gb`` and on the embedded corpus (its preparation cached by a first
   run), each in a fresh process: the seconds from the start of the process to its first step's record in
   ``metrics.jsonl`` and the process's peak resident memory.

``--start-only`` measures step 4 alone over a preparation already in ``WORK`` (its own section): first
``comera prepare`` runs again over it (a complete preparation: every shard checked, nothing encoded, the
record of checked shards written as at the end of a first preparation), then the two starts.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

DOCUMENT_BYTES = (1_000, 50_000)
FILE_BYTES = 256 * 10**6
SECTION = "prepare-corpus"
SAMPLE_PHASE = "reading the tokenizer's sample"


def library_texts() -> list[str]:
    """The standard library's sources and documentation topics, one text each."""
    import sysconfig
    from pydoc_data.topics import topics

    texts = list(topics.values())
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return [text for text in texts if len(text) > 200]


def make_corpus(folder: Path, gigabytes: float, seed: int = 0) -> dict[str, float]:
    """Write the corpus (module docstring) unless ``folder/done.json`` says it is there; its facts."""
    done = folder / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    texts = library_texts()
    lines = [text.splitlines(keepends=True) for text in texts]
    target = int(gigabytes * 10**9)
    written = documents = text_bytes = 0
    number = 0
    low, high = (math.log(size) for size in DOCUMENT_BYTES)
    while written < target:
        path = folder / f"c4like-{number:05d}.jsonl.gz"
        in_file = 0
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as file:
            while in_file < FILE_BYTES and written < target:
                size = int(math.exp(rng.uniform(low, high)))
                source = lines[rng.randrange(len(lines))]
                at = rng.randrange(len(source))
                pieces, held = [], 0
                while held < size:
                    piece = source[at % len(source)]
                    pieces.append(piece)
                    held += len(piece)
                    at += 1
                text = "".join(pieces)[:size]
                line = json.dumps({"text": text}) + "\n"
                file.write(line)
                in_file += len(line)
                written += len(line)
                text_bytes += len(text.encode("utf-8"))
                documents += 1
        number += 1
    facts = {
        "json_bytes": written,
        "text_bytes": text_bytes,
        "documents": documents,
        "files": number,
        "gz_bytes": sum(path.stat().st_size for path in folder.glob("*.jsonl.gz")),
    }
    done.write_text(json.dumps(facts))
    return facts


def watch(process: subprocess.Popen, every: float = 0.2) -> dict[str, float]:
    """Sample the memory of ``process`` and its descendants until it ends: peak sums of RSS and PSS (MiB)."""
    peaks = {"rss_mib": 0.0, "pss_mib": 0.0, "processes": 0}
    root = psutil.Process(process.pid)
    while process.poll() is None:
        rss = pss = 0
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for each in tree:
            try:
                info = each.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        peaks["rss_mib"] = max(peaks["rss_mib"], rss / 2**20)
        peaks["pss_mib"] = max(peaks["pss_mib"], pss / 2**20)
        peaks["processes"] = max(peaks["processes"], len(tree))
        time.sleep(every)
    return peaks


def comera(*args: str) -> list[str]:
    """The command line of ``python -m comera ARGS``."""
    return [sys.executable, "-m", "comera", *args]


def prepare(corpus: Path, out: Path, workers: int | None) -> dict[str, object]:
    """Run the preparation in a fresh process, watching its memory; its time, phase lines and peaks."""
    command = comera("prepare", "llm", "--data", str(corpus), "--out", str(out), "--preset", "small")
    if workers is not None:
        command += ["--workers", str(workers)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout or []), daemon=True)
    reader.start()
    peaks = watch(process)
    process.wait()
    reader.join()
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"comera prepare failed:\n{''.join(output[-20:])}")
    phases = {}
    for line in output:
        for name in (SAMPLE_PHASE, "training the tokenizer", "encoding"):
            if line.strip().startswith(f"{name}: "):
                rest = line.strip()[len(name) + 2 :]
                phases[name] = float(rest.split(" s", 1)[0].rsplit(" ", 1)[-1])
    return {"seconds": seconds, "phases": phases, **peaks, "output": output}


_CEILING_CHILD = """
import os, sys, time
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import json
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
texts = json.loads(open(sys.argv[2]).read())
method = getattr(tokenizer, sys.argv[3])
start_at = float(sys.argv[4])
while time.time() < start_at:
    time.sleep(0.01)
started = time.perf_counter()
for first in range(0, len(texts), 256):
    method(texts[first : first + 256], add_special_tokens=False)
print(time.perf_counter() - started)
"""


def ceiling(corpus: Path, tokenizer: Path, megabytes: float, processes: int) -> dict[str, float]:
    """``encode_batch`` and ``encode_batch_fast``'s rate (text MB/s) in ``processes`` processes of one
    thread each on the first ``megabytes`` MB of the corpus's texts."""
    texts, held = [], 0
    for path in sorted(corpus.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as file:
            for line in file:
                text = json.loads(line)["text"]
                texts.append(text)
                held += len(text.encode("utf-8"))
                if held >= megabytes * 10**6:
                    break
        if held >= megabytes * 10**6:
            break
    rates = {}
    with tempfile.TemporaryDirectory() as folder:
        parts = []
        for rank in range(processes):
            part = Path(folder) / f"part{rank}.json"
            part.write_text(json.dumps(texts[rank::processes]))
            parts.append(part)
        for method in ("encode_batch", "encode_batch_fast"):
            start_at = time.time() + 15  # every process has loaded its texts by then
            children = [
                subprocess.Popen(
                    [sys.executable, "-c", _CEILING_CHILD, str(tokenizer), str(part), method, str(start_at)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for part in parts
            ]
            seconds = max(float(child.communicate()[0]) for child in children)
            rates[method] = held / seconds / 10**6
    rates["ceiling_text_mb"] = held / 10**6
    return rates


def first_step(out: Path, data: Path | None, cache: Path) -> dict[str, float]:
    """Seconds from the start of ``comera train llm`` to its first step's record, and its peak RSS (MiB)."""
    command = comera("train", "llm", "--preset", "small", "--method", "dense", "--out", str(out))
    command += ["--cache", str(cache), "--no-progress"]
    for setting in ("train.early=3", "train.late=0", "train.log_every=1", "train.checkpoint_every=1000"):
        command += ["--set", setting]
    if data is not None:
        command += ["--data", str(data)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    peak = 0.0
    handle = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            peak = max(peak, handle.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            break
        if first is None and (out / "metrics.jsonl").is_file():
            for line in (out / "metrics.jsonl").read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("kind") == "train":
                    first = time.perf_counter() - started
                    break
        time.sleep(0.02)
    _, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"comera train failed:\n{stderr[-2000:]}")
    return {"first_step_s": first if first is not None else math.nan, "peak_rss_mib": peak}


def main() -> int:
    """Run the steps of the module docstring and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="GB of JSON lines in the corpus (default 2)")
    parser.add_argument("--work", type=Path, required=True, help="folder for the corpus and its preparation")
    parser.add_argument("--ceiling-mb", type=float, default=200, help="MB of text the ceiling encodes")
    parser.add_argument("--workers", type=int, default=None, help="comera prepare --workers (default: all)")
    parser.add_argument("--skip-train", action="store_true", help="leave out step 4")
    parser.add_argument("--start-only", action="store_true", help="step 4 alone, over WORK's preparation")
    parser.add_argument("--write", type=Path, default=None, help="update this markdown file's section")
    args = parser.parse_args()
    args.load_at_start = " ".join(f"{load:.2f}" for load in os.getloadavg())
    label = f"{args.gb:g}gb"
    corpus = args.work / f"corpus-{label}"
    out = args.work / f"prepared-{label}"
    if args.start_only:
        return start_only(args, corpus, out, label)
    made = time.perf_counter()
    facts = make_corpus(corpus, args.gb)
    print(f"corpus: {facts} ({time.perf_counter() - made:.0f} s)", flush=True)
    prepared = prepare(corpus, out, args.workers)
    print(f"prepare: {json.dumps({k: v for k, v in prepared.items() if k != 'output'})}", flush=True)
    cores = len(os.sched_getaffinity(0))
    rates = ceiling(corpus, out / "tokenizer.json", args.ceiling_mb, cores)
    print(f"ceiling: {rates}", flush=True)
    starts = {} if args.skip_train else training_starts(args.work, out)
    index = json.loads((out / "index.json").read_text())
    encoding = prepared["phases"].get("encoding", math.nan)
    encode_rate = facts["text_bytes"] / encoding / 10**6
    table = report(args, facts, prepared, rates, starts, index, encode_rate, cores)
    write(args, f"{SECTION}-{label}", table)
    return 0


def training_starts(work: Path, out: Path) -> dict[str, dict[str, float]]:
    """Step 4: the first step's time and the peak RSS on the embedded corpus and on ``out``."""
    starts = {}
    with tempfile.TemporaryDirectory(dir=work) as folder:
        cache = Path(folder) / "cache"
        first_step(Path(folder) / "warm", None, cache)  # prepares and caches the embedded corpus
        starts["embedded"] = first_step(Path(folder) / "embedded", None, cache)
        starts["prepared"] = first_step(Path(folder) / "prepared", out, cache)
    print(f"train: {starts}", flush=True)
    return starts


def write(args, section: str, table: str) -> None:
    """Print ``table`` and, with ``--write``, put it in that file's ``section``."""
    print(table)
    if args.write is not None:
        sys.path.insert(0, str(Path(__file__).parents[1] / "src"))
        from comera.measure import update_section

        update_section(args.write, section, table)


def start_only(args, corpus: Path, out: Path, label: str) -> int:
    """``--start-only`` (module docstring): its own section."""
    if not (out / "index.json").is_file():
        raise SystemExit(f"--start-only: no preparation in {out}; run without it first")
    again = prepare(corpus, out, args.workers)
    starts = training_starts(args.work, out)
    commit = _commit()
    embedded, ours = starts["embedded"], starts["prepared"]
    rows = [
        ("`comera prepare` again over the complete preparation", f"{again['seconds']:.0f} s", ""),
        ("`comera train llm --data PREPARED`: first step after", f"{ours['first_step_s']:.1f} s", "<= 5 s"),
        ("the same on the embedded corpus (cached)", f"{embedded['first_step_s']:.1f} s", ""),
        ("`comera train llm --data PREPARED`: peak RSS", f"{ours['peak_rss_mib']:.0f} MiB", "embedded + 100"),
        ("the same on the embedded corpus", f"{embedded['peak_rss_mib']:.0f} MiB", ""),
    ]
    lines = [
        f"## Training's start on a prepared {args.gb:g} GB corpus",
        "",
        f"Machine: {_cpu_model()}, {len(os.sched_getaffinity(0))} cores (load average "
        f"{args.load_at_start} at the start). Date {datetime.date.today().isoformat()}, commit "
        f"{commit}. Command: `python benchmarks/prepare_corpus.py --gb {args.gb:g} --work WORK "
        f"--start-only --write docs/benchmarks.md`, over the preparation of the section above "
        f"(`{out.name}`).",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        *(f"| {name} | {value} | {target} |" for name, value, target in rows),
    ]
    write(args, f"{SECTION}-{label}-start", "\n".join(lines))
    return 0


def _commit() -> str:
    """The checked-out commit's short hash."""
    command = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(command, capture_output=True, text=True).stdout.strip()


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def report(args, facts, prepared, rates, starts, index, encode_rate, cores) -> str:
    """The markdown section."""
    commit = _commit()
    tokens = sum(index["splits"][split]["tokens"] for split in ("train", "validation"))
    phases = prepared["phases"]
    whole_rate = facts["text_bytes"] / prepared["seconds"] / 1e6
    rows = [
        ("`comera prepare` wall time", f"{prepared['seconds']:.0f} s", ""),
        ("of which reading the tokenizer's sample", f"{phases.get(SAMPLE_PHASE, math.nan):.0f} s", ""),
        ("of which training the tokenizer", f"{phases.get('training the tokenizer', math.nan):.0f} s", ""),
        ("of which encoding", f"{phases.get('encoding', math.nan):.0f} s", ""),
        (
            f"peak RSS, all processes summed ({prepared['processes']} at most)",
            f"{prepared['rss_mib']:.0f} MiB",
            "< 1536 MiB",
        ),
        ("peak PSS, all processes summed", f"{prepared['pss_mib']:.0f} MiB", ""),
        ("encoding rate (text)", f"{encode_rate:.2f} MB/s", ""),
        ("whole preparation rate (text)", f"{whole_rate:.2f} MB/s", ""),
    ]
    for method in ("encode_batch", "encode_batch_fast"):
        rows.append((f"ceiling: `{method}`, {cores} processes of 1 thread", f"{rates[method]:.2f} MB/s", ""))
    rows.append(
        ("encoding rate / `encode_batch` ceiling", f"{encode_rate / rates['encode_batch']:.0%}", ">= 70 %")
    )
    rows.append(
        ("encoding rate / `encode_batch_fast` ceiling", f"{encode_rate / rates['encode_batch_fast']:.0%}", "")
    )
    if starts:
        embedded, ours = starts["embedded"], starts["prepared"]
        rows += [
            (
                "`comera train llm --data PREPARED`: first step after",
                f"{ours['first_step_s']:.1f} s",
                "<= 5 s",
            ),
            ("the same on the embedded corpus (cached)", f"{embedded['first_step_s']:.1f} s", ""),
            (
                "`comera train llm --data PREPARED`: peak RSS",
                f"{ours['peak_rss_mib']:.0f} MiB",
                "embedded + 100",
            ),
            ("the same on the embedded corpus", f"{embedded['peak_rss_mib']:.0f} MiB", ""),
        ]
    lines = [
        f"## Preparing a {args.gb:g} GB corpus: memory, throughput, training's start",
        "",
        f"Machine: {_cpu_model()}, {cores} cores (load average {args.load_at_start} at the start). "
        f"Date {datetime.date.today().isoformat()}, commit {commit}. Command: `python "
        f"benchmarks/prepare_corpus.py --gb {args.gb:g} --work WORK --ceiling-mb {args.ceiling_mb:g} "
        "--write docs/benchmarks.md`.",
        "",
        f"Corpus: {facts['files']} `.jsonl.gz` files, {facts['documents']:,} documents of 1-50 KB, "
        f"{facts['json_bytes'] / 1e9:.2f} GB of JSON lines, {facts['text_bytes'] / 1e9:.2f} GB of text, "
        f"{facts['gz_bytes'] / 1e9:.2f} GB compressed; {tokens:,} tokens prepared "
        "(`--preset small`: a 4096-token BPE trained on the default 100 MB sample, `uint16` shards).",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        *(f"| {name} | {value} | {target} |" for name, value, target in rows),
        "",
        f"The ceiling encoded the first {rates['ceiling_text_mb']:.0f} MB of the corpus's text in the same "
        "run; "
        "rates are UTF-8 text bytes per second.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
