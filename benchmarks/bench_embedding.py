"""Embedding lookup benchmark; see ``comera.bench.embedding`` (also ``comera bench embedding``)."""

import sys

from comera.bench.embedding import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
