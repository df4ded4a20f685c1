"""Linear-layer benchmark; see ``comera.bench.layers`` (also ``comera bench layers``)."""

import sys

from comera.bench.layers import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
