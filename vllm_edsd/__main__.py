"""``python -m vllm_edsd`` is the ``edsd`` command; ``torchrun -m vllm_edsd train ...`` runs it
on every rank."""

import sys

from vllm_edsd.cli import main

sys.exit(main())
