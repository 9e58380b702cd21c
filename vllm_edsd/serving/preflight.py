"""Where a model vLLM is about to load is, checked before vLLM looks for it: a drafter named by
``"model"``, or the target (the *verifier*) a speculators-format drafter directory names when it
is served alone (docs/formats.md, "Speculators format"). A missing local directory is one line
with the absolute path tried, not a pydantic traceback from vLLM's fall-back to the model hub."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from vllm_edsd.checkpoint.files import load_json
from vllm_edsd.errors import EDSDError, first_line
from vllm_edsd.methods.edsd.config import SPECULATORS_MODEL_TYPE, Speculators

DRAFTER = "speculative config 'model'"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def no_such_directory(model: str, what: str = DRAFTER) -> EDSDError:
    return EDSDError(f"{what}: no such local directory: {os.path.abspath(model)}")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _looks_like_hub_id(model: str) -> bool:
    """``org/name`` that is not a local path. A missing ``runs/edsd`` whose ``runs/`` exists here
    is a mistyped path."""
    return HUB_ID.fullmatch(model) is not None and not os.path.isdir(model.split("/")[0])


def _in_hub_cache(model: str) -> bool:
    """With the hub switched off (``HF_HUB_OFFLINE``) vLLM still loads a repository it downloaded before."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def _check_hub(model: str, what: str = DRAFTER) -> None:
    """``model`` is no local directory, so vLLM would fetch it from the model hub: refuse it here
    when the hub cannot be reached or has no such repository. Any other answer of the hub
    (a gated or private repository) is left to vLLM, which reports it."""
    from huggingface_hub import file_exists
    from huggingface_hub.errors import HfHubHTTPError

    try:
        found = file_exists(model, "config.json")
    except HfHubHTTPError:
        return
    except Exception as exc:  # no network, DNS, proxy, certificates: whatever the HTTP client raises
        raise EDSDError(f"{no_such_directory(model, what)}, and the model hub could not be reached to look up "
                        f"{model!r} ({type(exc).__name__}: {first_line(exc, limit=500)})") from exc
    if not found:
        raise EDSDError(f"{no_such_directory(model, what)}, and the model hub has no repository {model!r}")


def locate(model: str, what: str = DRAFTER) -> bool:
    """True for a local path; False for a model hub id that vLLM will resolve (the hub has it,
    or, offline, its cache does). Anything else is refused in one line naming ``what``."""
    if os.path.exists(model):
        return True
    if _looks_like_hub_id(model):
        if not _hub_offline():
            _check_hub(model, what)
            return False
        if _in_hub_cache(model):
            return False
    raise no_such_directory(model, what)


def check_verifier(model: Any) -> None:
    """``vllm serve DRAFTER_DIR``: vLLM loads the verifier the drafter's config.json names as the
    target. One that cannot be found is one line here, before vLLM's traceback. Any model but a
    local EDSD drafter directory in the speculators format is left to vLLM."""
    config = Path(model, "config.json") if isinstance(model, str) else None
    if config is None or not config.is_file():
        return
    try:
        raw = load_json(config)
    except (EDSDError, OSError):
        return  # vLLM reports its own model's unreadable config
    if not isinstance(raw, dict) or raw.get("speculators_model_type") != SPECULATORS_MODEL_TYPE:
        return
    source = f"{model}/config.json"
    verifier = Speculators.from_config(raw, source).verifier
    locate(verifier, f"{source}: verifier (speculators_config.verifier.name_or_path)")
