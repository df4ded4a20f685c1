"""Training a tokenizer prints nothing, even on a terminal: ``tokenizers`` draws its progress bars only when
standard error is a terminal, so the check gives the process a pseudo-terminal as standard error while it
trains (a bar would otherwise fill the logs of every run that trains one)."""

import os
import threading
from collections.abc import Callable

import pytest

from comera.data.bpe import train_tokenizer
from comera.data.tokenize import train_wordpiece

pty = pytest.importorskip("pty")  # POSIX only

PROSE = "the cat sat on the mat " * 20 + "dogs run fast and far " * 20


def _stderr_on_a_terminal(action: Callable[[], object]) -> bytes:
    """What ``action`` writes to file descriptor 2 while that is a pseudo-terminal (read as it is written,
    so that a long output cannot fill the terminal's buffer and block the writer)."""
    leader, follower = pty.openpty()
    received: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # every follower descriptor closed
                return
            if not chunk:
                return
            received.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    saved = os.dup(2)
    try:
        os.dup2(follower, 2)
        action()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(follower)
    reader.join(timeout=10)
    os.close(leader)
    return b"".join(received)


def test_the_check_sees_what_is_written_to_the_terminal():
    """The probe itself: bytes written to descriptor 2 come back (the terminal turns "\\n" into "\\r\\n")."""
    assert _stderr_on_a_terminal(lambda: os.write(2, b"bar\n")) == b"bar\r\n"


def test_bpe_training_shows_no_progress_bar():
    """Byte-level BPE training (``show_progress=False``) writes nothing to a terminal."""
    assert _stderr_on_a_terminal(lambda: train_tokenizer([PROSE], 300)) == b""


def test_wordpiece_training_shows_no_progress_bar():
    """WordPiece training (``show_progress=False``) writes nothing to a terminal."""
    assert _stderr_on_a_terminal(lambda: train_wordpiece([PROSE], 100)) == b""
