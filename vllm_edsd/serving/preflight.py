"""Where a drafter named by ``"model"`` is, checked before vLLM looks for it: a missing local
directory is one line with the absolute path tried, not a pydantic traceback from vLLM's
fall-back to the model hub."""

from __future__ import annotations

import os

from vllm_edsd.errors import EDSDError


def no_such_directory(model: str) -> EDSDError:
    return EDSDError(f"speculative config 'model': no such local directory: {os.path.abspath(model)}")


def check_hub_drafter(model: str) -> None:
    """``model`` is no local directory, so vLLM would fetch it from the model hub: refuse it here
    when the hub cannot be reached or has no such repository. Any other answer of the hub
    (a gated or private repository) is left to vLLM, which reports it."""
    from huggingface_hub import file_exists
    from huggingface_hub.errors import HfHubHTTPError

    try:
        found = file_exists(model, "config.json")
    except HfHubHTTPError:
        return
    except Exception as exc:  # no network, DNS, proxy: whatever the HTTP client raises
        raise EDSDError(f"{no_such_directory(model)}, and the model hub could not be reached to look up "
                        f"{model!r} ({type(exc).__name__})") from None
    if not found:
        raise EDSDError(f"{no_such_directory(model)}, and the model hub has no repository {model!r}")
