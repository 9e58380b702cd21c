"""How a refusal raised inside vLLM's configuration reaches the user: one line and exit status 2
where the process is vLLM's server, the ``EDSDError`` itself for a library caller
(``LLM(...)``). The ``EXCEPTION`` rows of ``patches.PATCHES`` name ``errors_for_the_user``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from vllm_edsd.errors import EDSDError

SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")


def serving_from_command_line() -> bool:
    """This process is ``vllm serve`` or ``python -m vllm.entrypoints.openai.api_server``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return spec.name in SERVER_MODULES
    return os.path.basename(sys.argv[0]) == "vllm" and "serve" in sys.argv[1:2]


@contextmanager
def errors_for_the_user() -> Iterator[None]:
    """A server's user reads one line, not vLLM's traceback; a library caller (``LLM(...)``)
    gets the exception."""
    try:
        yield
    except EDSDError as exc:
        if serving_from_command_line():
            print(f"vllm-edsd: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        raise
