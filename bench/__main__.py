"""``python -m bench SUITE``: see ``bench/cli.py`` (``python -m bench --help``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
