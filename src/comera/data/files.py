"""Reading data files: gzip and zstd decompressed by content, other archives (bzip2, xz, zip, tar) refused by
name, a leading UTF-8 byte-order mark skipped, and truncated streams or bytes that are not UTF-8 reported
naming the file. Details: docs/recipes.md, 'Errors'.
"""

from __future__ import annotations

import codecs
import errno
import gzip
import io
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

try:
    import zstandard
except ImportError:
    zstandard = None

__all__ = [
    "GZIP_MAGIC",
    "ZSTD_EXTRA",
    "ZSTD_MAGIC",
    "check_data_path",
    "check_regular_file",
    "open_data",
    "reading",
    "numbered_lines",
    "utf8_text",
    "utf8_problem",
    "without_bom",
]

GZIP_MAGIC = b"\x1f\x8b"
"""The first two bytes of a gzip file."""
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
"""The first four bytes of a zstd frame."""
ZSTD_EXTRA = "pip install 'comera[zstd]' (or pip install zstandard)"
"""How to get the package that decompresses zstd files."""
_UNSUPPORTED = {
    b"BZh": "bzip2-compressed",
    b"\xfd7zXZ\x00": "xz-compressed",
    b"PK\x03\x04": "a zip archive",
}
_STREAM_ERRORS: tuple[type[Exception], ...] = (EOFError, zlib.error) + (
    (zstandard.ZstdError,) if zstandard is not None else ()
)
_TAR_MAGIC, _TAR_MAGIC_AT = b"ustar", 257
_BOM = codecs.BOM_UTF8


def check_data_path(path: str | os.PathLike) -> Path:
    """``path`` (the ``--data`` of a command) as a ``Path`` when something is there.

    Raises:
        FileNotFoundError: nothing is there (``--data PATH: no such file or folder``). ValueError: ``path`` is
            a symbolic link that loops or points at nothing (said so, with where it points).
    """
    path = Path(path)
    if path.exists():
        return path
    if not path.is_symlink():
        raise FileNotFoundError(f"--data {path}: no such file or folder")
    try:
        os.stat(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError(
                f"--data {path}: a symbolic link that loops (it leads back to itself); point it at the data "
                "or give the data's own path"
            ) from None
    raise ValueError(
        f"--data {path}: a broken symbolic link (to {os.readlink(path)}, which does not exist); point it at "
        "the data or give the data's own path"
    )


def without_bom(data: bytes) -> bytes:
    """``data`` without a leading UTF-8 byte-order mark."""
    return data.removeprefix(_BOM)


def _format_of(head: bytes) -> str | None:
    for magic, name in _UNSUPPORTED.items():
        if head.startswith(magic):
            return name
    if head[_TAR_MAGIC_AT : _TAR_MAGIC_AT + len(_TAR_MAGIC)] == _TAR_MAGIC:
        return "a tar archive"
    return None


def check_regular_file(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming ``path`` when it is there but is not a regular file once links are
    followed: a pipe (reading it would wait forever), a device, a socket, a broken or looping link. A
    missing path or a folder passes (opening it says what is wrong)."""
    path = Path(path)
    if path.is_file() or path.is_dir() or not (path.is_symlink() or path.exists()):
        return
    raise ValueError(
        f"{path}: not a regular file (a pipe, a device, or a broken or looping link); remove it or replace "
        "it with the data file"
    )


def open_data(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for reading bytes, decompressed when it is gzip or zstd, past a leading UTF-8
    byte-order mark.

    Raises:
        ValueError: the file (or the compressed file's content) is a bzip2, xz, zip or tar archive, the
            message naming the format and the file; it is zstd and ``zstandard`` is not installed (the
            message says how to install it); it is not a regular file (:func:`check_regular_file`); or it
            cannot be opened (no permission), the message naming the file and the reason.
    """
    path = Path(path)
    check_regular_file(path)
    try:
        with open(path, "rb") as probe:
            first = probe.read(len(ZSTD_MAGIC))
    except (PermissionError, IsADirectoryError) as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror})") from None
    opener, compression = _decompressing_opener(path, first)
    handle = opener()
    try:
        with reading(path):
            head = handle.read(_TAR_MAGIC_AT + len(_TAR_MAGIC))
    finally:
        handle.close()
    found = _format_of(head)
    if compression and head.startswith(GZIP_MAGIC):
        found = "gzip-compressed"
    elif compression and head.startswith(ZSTD_MAGIC):
        found = "zstd-compressed"
    if found is not None:
        inside = f" inside {compression}" if compression else ""
        raise ValueError(f"{path}: {found}{inside}, not a text file; extract or decompress it first")
    handle = opener()
    if head.startswith(_BOM):
        handle.read(len(_BOM))
    return handle


def _decompressing_opener(path: Path, first: bytes) -> tuple[Callable[[], BinaryIO], str]:
    """A function opening ``path`` for reading its (decompressed) bytes, and the compression's name ("" for
    none), chosen by the file's ``first`` bytes."""
    if first.startswith(GZIP_MAGIC):
        return (lambda: gzip.open(path, "rb")), "gzip"  # type: ignore[return-value]
    if first.startswith(ZSTD_MAGIC):
        if zstandard is None:
            raise ValueError(f"{path}: zstd-compressed, and zstandard is not installed: {ZSTD_EXTRA}")
        return (lambda: io.BufferedReader(_ZstdFrames(path))), "zstd"
    return (lambda: open(path, "rb")), ""  # noqa: SIM115


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of the zstd file at ``path``, frame after frame; input that ends inside a frame
    raises ``EOFError`` (``zstandard``'s own reader returns what it has and stops without a word)."""

    _CHUNK = 1 << 16

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._inside_frame = False
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        while not self._pending:
            chunk = self._file.read(self._CHUNK)
            if not chunk:
                if self._inside_frame:
                    raise EOFError("the zstd data ends inside a frame")
                return 0
            self._pending = self._decompress(chunk)
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._inside_frame = not self._frame.eof
            data = self._frame.unused_data if self._frame.eof else b""
            if self._frame.eof:
                self._frame = self._decompressor.decompressobj()
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


@contextmanager
def reading(path: str | os.PathLike, where: str = "") -> Iterator[None]:
    """Raise a truncated or corrupt compressed stream read inside the block as ``ValueError`` naming
    ``path`` (and ``where``, e.g. ``"after line 12"``). Bytes that follow the last whole gzip member (the
    first member's header was checked when the file was opened) are named as such, without ``where``:
    the decompressor drops the lines of the read that found them, so no line number would be right."""
    try:
        yield
    except gzip.BadGzipFile as error:
        if str(error).startswith("Not a gzipped file"):
            raise ValueError(
                f"{path}: bytes that are not gzip data follow the end of the compressed data ({error}); the "
                "file is damaged or was joined to another one: decompress it (gzip -d drops them with a "
                "warning) and pass the text file"
            ) from None
        raise _damaged(path, where, error) from None
    except _STREAM_ERRORS as error:
        raise _damaged(path, where, error) from None


def _damaged(path: str | os.PathLike, where: str, error: Exception) -> ValueError:
    place = f" ({where})" if where else ""
    return ValueError(f"{path}: the compressed data is truncated or corrupt{place}: {error}")


def numbered_lines(
    file: BinaryIO, path: str | os.PathLike, max_line_bytes: int | None = None
) -> Iterator[tuple[int, bytes]]:
    """``(line number from 1, bytes)`` of ``file``; a line longer than ``max_line_bytes`` comes as its first
    ``max_line_bytes + 1`` bytes (the rest read in pieces and dropped), so one huge line is never held
    whole.

    Raises:
        ValueError: a truncated or corrupt gzip stream, naming ``path`` and the last line read.
    """
    size = -1 if max_line_bytes is None else max_line_bytes + 1
    number = 0
    while True:
        with reading(path, f"after line {number}"):
            raw = file.readline(size)
            if len(raw) == size and not raw.endswith(b"\n"):
                _drop_rest_of_line(file, size)
        if not raw:
            return
        number += 1
        yield number, raw


def _drop_rest_of_line(file: BinaryIO, size: int) -> None:
    """Read ``file`` up to the end of the current line, ``size`` bytes at a time, keeping nothing."""
    while True:
        piece = file.readline(size)
        if not piece or piece.endswith(b"\n"):
            return


def utf8_problem(error: UnicodeDecodeError) -> str:
    """``"byte 0xe9 at offset 12 is not valid UTF-8"`` for a failed decoding of one line."""
    return f"byte 0x{error.object[error.start]:02x} at offset {error.start} is not valid UTF-8"


def utf8_text(data: bytes, path: str | os.PathLike) -> str:
    """``data`` decoded as UTF-8, a leading byte-order mark dropped; ``ValueError`` naming ``path``, the line,
    the column and the byte."""
    data = without_bom(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = data.rfind(b"\n", 0, error.start) + 1
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{path}: line {line}, column {error.start - line_start + 1}: byte "
            f"0x{data[error.start]:02x} is not valid UTF-8 (save the file as UTF-8)"
        ) from None
