"""How vLLM learns about EDSD: two registrations and the changes of ``patches.PATCHES`` (the table
of every change the plugin makes to vLLM, docs/architecture.md, "Patches"), made by ``install``.

* The draft class (``EDSD_METHOD.vllm_model``) is registered with ``ModelRegistry`` under the
  architecture names the converted checkpoints carry (vLLM prefixes ``Eagle3`` to eagle3
  drafts, so both).
* ``"edsd"`` is registered as a speculators model type, so that ``vllm serve DRAFTER_DIR``
  serves a converted drafter alone: vLLM reads target and ``"method": "edsd"`` from its
  config.json (docs/formats.md, "Speculators format"), and the request then takes the path of
  any ``"edsd"`` request (``request.py``). The verifier it names is looked for before vLLM
  loads it (``preflight``).
"""

from __future__ import annotations

import logging
import os

from vllm_edsd.methods import EDSD_METHOD
from vllm_edsd.serving.features import lookup
from vllm_edsd.serving.patches import PATCHES, REFUSAL
from vllm_edsd.serving.versions import range_message, version_supported, vllm_version

logger = logging.getLogger("vllm.edsd")  # a child of vLLM's logger: its handlers and level

METHOD = EDSD_METHOD.name  # vLLM takes a speculators config's model type as the method
SERVED_LAYOUT = EDSD_METHOD.served_layout
DISABLE_ENV = "VLLM_EDSD_DISABLE"
_installed = False


def speculators_pre_trained_config(config_dict: dict, pre_trained_config: dict) -> None:
    """vLLM's updater for ``speculators_model_type: "edsd"``: the draft model's config, for
    readers that build it from a speculators config (``SpeculatorsConfig.from_pretrained``,
    where config.json has no ``model_type``). The drafter's config is read and written by the
    one parser (docs/formats.md), so it holds our architecture, the draft vocabulary, the aux
    layer ids and ``edsd_config`` exactly as the vLLM layout does."""
    drafter = SERVED_LAYOUT.read_config(config_dict, source="speculators config")
    pre_trained_config.update(SERVED_LAYOUT.config_json(drafter.with_updates(speculators=None)))


def _register_speculators_type() -> None:
    """``"edsd"`` in vLLM's speculators registry, through its own ``register_speculator``
    (a registration, not a patch: docs/architecture.md), where this vLLM has one."""
    try:
        from vllm.transformers_utils.configs.speculators.algos import register_speculator
    except ImportError:
        return
    register_speculator(METHOD)(speculators_pre_trained_config)
    logger.debug("vllm-edsd: registered the speculators model type %r", METHOD)


def _register_model() -> None:
    """The draft model class in vLLM's ``ModelRegistry``, under every architecture name of the
    vLLM layout (vLLM builds the drafter from its ``architectures``)."""
    from vllm import ModelRegistry

    for name in SERVED_LAYOUT.architectures:
        ModelRegistry.register_model(name, EDSD_METHOD.vllm_model)


def _refuse_outside_range(version: str) -> None:
    """On a vLLM outside the supported range: one warning, and only ``REFUSAL``."""
    logger.warning("vllm-edsd: %s; the plugin refuses \"method\": \"%s\" and leaves the rest of vLLM "
                   "untouched", range_message(version), METHOD)
    try:
        REFUSAL.apply()
    except (ImportError, AttributeError):  # a vLLM that moved its SpeculativeConfig: its own error then
        logger.debug("vllm-edsd: %s not found; \"%s\" gets vLLM's own error", REFUSAL.name, METHOD)


def install() -> None:
    """Register the model class and the method alias in this process, once.

    Nothing happens with ``VLLM_EDSD_DISABLE=1``. On a vLLM outside the supported range there is
    one warning and one replacement (``REFUSAL``): ``"method": "edsd"`` is refused by name, and
    every other request reaches vLLM untouched. A plugin must never take down vLLM processes
    that do not use it."""
    global _installed
    if _installed or os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return
    version = vllm_version()
    if not version_supported(version):
        _refuse_outside_range(version)
        _installed = True
        return
    _register_model()
    _register_speculators_type()
    for patch in PATCHES:
        if patch.at_load and (patch.only_if is None or patch.only_if()):
            patch.apply()
    lookup.add_worker_method()
    _installed = True
