"""``python -m weights_convert SRC DST ...`` is ``edsd convert SRC DST ...``."""

import sys

from vllm_edsd.cli import main

sys.exit(main(["convert", *sys.argv[1:]]))
