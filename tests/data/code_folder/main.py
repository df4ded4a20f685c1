import sys

from pkg.util import clamp


def main(argv):
    """Entry point."""
    values = [clamp(int(a), 0, 10) for a in argv]
    print(sum(values))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
