"""A prose corpus from what a Linux machine has installed: a folder of ``.txt`` documents for
``comera train llm --data FOLDER``, so that a language-model comparison tuned on the default corpus (Python
sources) can be repeated on text that is not code.

    python benchmarks/prose_corpus.py --out /tmp/prose [--mb 24]

Sources, in this order, each used when present, until the documents hold ``--mb`` MB (10**6 bytes) of text:

1. the books of the Rust toolchain's documentation
   (``~/.rustup/toolchains/*/share/doc/rust/html/*/print.html``, mdBook's one-page form of each book: the
   Rust book, the reference, the nomicon, cargo's and rustc's books ...), one document per chapter
   (``<h1>``), with code blocks (``<pre>``), scripts and navigation left out;
2. Vim's help files (``/usr/share/vim/vim*/doc/*.txt``), one document each;
3. manual pages of sections 1, 5 and 8 (``/usr/share/man``), rendered by ``man`` at 80 columns without
   formatting, one document each, in name order.

The folder also gets ``SOURCES.md``: the documents and megabytes taken from each source. The exit status is
1 when the sources found hold less than ``--mb``.
"""

from __future__ import annotations

import argparse
import glob
import html.parser
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

_SKIPPED_TAGS = {"pre", "script", "style", "nav", "head", "button", "noscript"}
_BLOCK_TAGS = {"p", "li", "h1", "h2", "h3", "h4", "h5", "h6", "dt", "dd", "tr", "blockquote", "div", "br"}


class _Chapters(html.parser.HTMLParser):
    """The text of an mdBook ``print.html`` split at each ``<h1>``: paragraphs on lines of their own, code
    blocks and page furniture left out."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.chapters: list[list[str]] = [[]]
        self._skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIPPED_TAGS:
            self._skipping += 1
        elif tag == "h1" and any(self.chapters[-1]):
            self.chapters.append([])
        if tag in _BLOCK_TAGS:
            self.chapters[-1].append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED_TAGS:
            self._skipping = max(0, self._skipping - 1)
        elif tag in _BLOCK_TAGS:
            self.chapters[-1].append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self.chapters[-1].append(data)


def _tidy(text: str) -> str:
    lines = (re.sub(r"[ \t]+", " ", line).strip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def rust_book_chapters() -> Iterator[tuple[str, str]]:
    """(name, text) of every chapter of the Rust toolchain's mdBooks (one toolchain, the first found)."""
    pattern = os.path.expanduser("~/.rustup/toolchains/*/share/doc/rust/html")
    roots = sorted(glob.glob(pattern))
    for page in sorted(Path(roots[0]).glob("*/print.html")) if roots else []:
        parser = _Chapters()
        parser.feed(page.read_text(errors="replace"))
        for number, chapter in enumerate(parser.chapters):
            text = _tidy("".join(chapter))
            if len(text) > 500:
                yield f"rust-{page.parent.name}-{number:03d}", text


def vim_help_files() -> Iterator[tuple[str, str]]:
    """(name, text) of every Vim help file."""
    for path in sorted(glob.glob("/usr/share/vim/vim*/doc/*.txt")):
        yield f"vim-{Path(path).stem}", _tidy(Path(path).read_text(errors="replace"))


def manual_pages() -> Iterator[tuple[str, str]]:
    """(name, text) of the manual pages of sections 1, 5 and 8, rendered by ``man`` without formatting."""
    environment = {**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "0", "LC_ALL": "C.UTF-8"}
    for section in ("1", "5", "8"):
        for path in sorted(glob.glob(f"/usr/share/man/man{section}/*")):
            done = subprocess.run(
                ["man", "-l", "-P", "cat", path], capture_output=True, env=environment, check=False
            )
            text = re.sub(r".\x08", "", done.stdout.decode(errors="replace"))
            if done.returncode == 0 and len(text) > 500:
                yield f"man{section}-{Path(path).name.split('.')[0]}", _tidy(text)


SOURCES = {"rust books": rust_book_chapters, "vim help": vim_help_files, "manual pages": manual_pages}


def main(argv: list[str] | None = None) -> int:
    """Write the corpus; 1 when the sources hold less than ``--mb``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the documents (made if missing)")
    parser.add_argument("--mb", type=float, default=24.0, help="megabytes of text (default 24)")
    args = parser.parse_args(argv)
    if args.mb <= 0:
        parser.error(f"--mb must be > 0, got {args.mb}")
    args.out.mkdir(parents=True, exist_ok=True)
    wanted, written, table = int(args.mb * 1e6), 0, []
    for source, documents in SOURCES.items():
        count = size = 0
        for name, text in documents():
            if written >= wanted:
                break
            data = text.encode()
            (args.out / f"{name}.txt").write_bytes(data)
            count, size, written = count + 1, size + len(data), written + len(data)
        table.append(f"| {source} | {count} | {size / 1e6:.2f} |")
    summary = ["# Sources", "", "| source | documents | MB |", "|---|---|---|", *table, ""]
    summary.append(f"Total: {written / 1e6:.2f} MB of text.")
    (args.out / "SOURCES.md").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 0 if written >= wanted else 1


if __name__ == "__main__":
    sys.exit(main())
