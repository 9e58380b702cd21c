"""``python -m vllm_edsd`` is the ``edsd`` command; ``torchrun -m vllm_edsd train ...`` runs it
on every rank."""

from vllm_edsd.cli import console

console()
