"""A tokenizing worker process of :class:`comera.data.encode_pool.EncodePool`, run as a script by its path so
that it imports ``tokenizers`` and ``numpy`` only: it reads requests (``n``, ``n`` uint64 byte lengths, the
UTF-8 texts; ``n = 0`` ends it) on standard input and answers each (``n``, ``n`` uint64 token counts, the
ids as the ``DTYPE`` array) on standard output, in order, on one thread.
"""

from __future__ import annotations

import os
import sys
from typing import BinaryIO

__all__ = ["encode_request", "main", "read_exactly"]

_COUNT = 8


def read_exactly(stream: BinaryIO, size: int) -> bytes:
    """``size`` bytes of ``stream``; ``EOFError`` when it ends before (the other side is gone)."""
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"the stream ended after {len(data)} of {size} bytes")
    return data


def encode_request(texts: list[str]) -> bytes:
    """The request frame of ``texts``."""
    import numpy as np

    encoded = [text.encode("utf-8", "surrogatepass") for text in texts]
    lengths = np.array([len(data) for data in encoded], dtype="<u8")
    return len(encoded).to_bytes(_COUNT, "little") + lengths.tobytes() + b"".join(encoded)


def main(argv: list[str]) -> int:
    """Serve requests until a request of 0 texts or the end of standard input."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(argv[1])
    dtype = np.dtype(argv[2])
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            count = int.from_bytes(read_exactly(source, _COUNT), "little")
        except EOFError:
            return 0
        if count == 0:
            return 0
        lengths = np.frombuffer(read_exactly(source, count * 8), dtype="<u8")
        data = read_exactly(source, int(lengths.sum()))
        bounds = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
        texts = [
            data[start:end].decode("utf-8", "surrogatepass") for start, end in zip(bounds[:-1], bounds[1:])
        ]
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        arrays = [np.array(encoding.ids, dtype=dtype) for encoding in encodings]
        counts = np.array([array.size for array in arrays], dtype="<u8")
        sink.write(count.to_bytes(_COUNT, "little") + counts.tobytes())
        for array in arrays:
            sink.write(array.tobytes())
        sink.flush()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
