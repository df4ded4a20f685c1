"""Tokenizing on every core: batches of texts encoded by worker processes (one core each, at most ``2 *
workers`` batches in flight), answered in submission order (:class:`EncodePool`), what ``comera prepare``
encodes a corpus with. Details: docs/llm.md, 'Bringing a corpus' ('Encoding').
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np
from tokenizers import Tokenizer

from comera.checks import check_int
from comera.data import encode_worker

__all__ = ["EncodePool", "available_cores"]

T = TypeVar("T")
_IN_FLIGHT_PER_WORKER = 2
_RUN_WORKER = (
    "import runpy, sys; sys.path = [p for p in sys.path if p not in ('', '.')]; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
"""Runs the worker script by its path without putting its folder (or the current one) on ``sys.path``:
``comera/data/tokenize.py`` would hide the standard library's ``tokenize``."""


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class _Worker:
    """One worker process and the thread that reads its answers into a queue."""

    def __init__(self, tokenizer_file: Path, dtype: np.dtype) -> None:
        env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        script = Path(encode_worker.__file__)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _RUN_WORKER, str(script), str(tokenizer_file), dtype.str],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.dtype = dtype
        self.answers: queue.Queue[list[np.ndarray] | BaseException] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        try:
            while True:
                count = int.from_bytes(encode_worker.read_exactly(stdout, 8), "little")
                counts = np.frombuffer(encode_worker.read_exactly(stdout, count * 8), dtype="<u8")
                total = int(counts.sum()) * self.dtype.itemsize
                ids = np.frombuffer(encode_worker.read_exactly(stdout, total), dtype=self.dtype)
                bounds = [0, *np.cumsum(counts, dtype=np.int64).tolist()]
                self.answers.put([ids[start:end] for start, end in zip(bounds[:-1], bounds[1:])])
        except BaseException as error:  # the worker ended: EOF, or a broken pipe
            self.answers.put(error)

    def send(self, texts: list[str]) -> None:
        stdin: IO[bytes] | None = self.process.stdin
        assert stdin is not None
        try:
            stdin.write(encode_worker.encode_request(texts))
            stdin.flush()
        except (BrokenPipeError, OSError):
            raise self.failure() from None

    def answer(self) -> list[np.ndarray]:
        found = self.answers.get()
        if isinstance(found, BaseException):
            raise self.failure()
        return found

    def failure(self) -> RuntimeError:
        self.process.wait(timeout=30)
        stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
        return RuntimeError(
            f"a tokenizing worker process ended with status {self.process.returncode}: {last}"
        )

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write((0).to_bytes(8, "little"))
                self.process.stdin.close()
            except OSError:
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


class EncodePool:
    """Worker processes encoding batches of texts with the tokenizer in ``tokenizer_file`` (``workers=0``:
    in this process); a context manager that ends them.

    Args:
        tokenizer_file: a ``tokenizer.json``.
        dtype: the ids' type (``uint16`` or ``uint32``, as the shards hold them).
        workers: worker processes (>= 0; 0 encodes in this process).

    Example:
        >>> with EncodePool(path, np.dtype("<u2"), workers=2) as pool:  # doctest: +SKIP
        ...     for tag, ids in pool.encode([("a", ["def f():", "x = 1"])]):
        ...         print(tag, [list(each) for each in ids])
    """

    def __init__(self, tokenizer_file: str | os.PathLike, dtype: np.dtype, workers: int) -> None:
        self.workers = check_int(workers, "workers", 0)
        self.dtype = np.dtype(dtype)
        self._tokenizer: Tokenizer | None = None
        self._workers: list[_Worker] = []
        if workers == 0:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        else:
            self._workers = [_Worker(Path(tokenizer_file), self.dtype) for _ in range(workers)]

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """End the worker processes (each finishes its batch first)."""
        for worker in self._workers:
            worker.close()
        self._workers = []

    def encode(self, batches: Iterable[tuple[T, list[str]]]) -> Iterator[tuple[T, list[np.ndarray]]]:
        """``(tag, ids of each text)`` for each ``(tag, texts)`` of ``batches``, in their order; ``batches``
        is read lazily, at most ``2 * workers`` batches ahead of what was yielded.

        Raises:
            RuntimeError: a worker process ended, with the last line it wrote on standard error.
            ValueError: an empty batch.
        """
        if self._tokenizer is not None:
            for tag, texts in batches:
                encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
                yield tag, [np.array(encoding.ids, dtype=self.dtype) for encoding in encodings]
            return
        pending: deque[tuple[_Worker, T]] = deque()
        for turn, (tag, texts) in enumerate(batches):
            if not texts:
                raise ValueError("batches must hold at least one text each, got an empty batch")
            if len(pending) >= _IN_FLIGHT_PER_WORKER * len(self._workers):
                worker, first = pending.popleft()
                yield first, worker.answer()
            worker = self._workers[turn % len(self._workers)]
            worker.send(texts)
            pending.append((worker, tag))
        while pending:
            worker, first = pending.popleft()
            yield first, worker.answer()
