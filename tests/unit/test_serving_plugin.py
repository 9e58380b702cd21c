"""The plugin's own start-up: what it replaces in vLLM, when, and when it leaves vLLM alone.

Each case runs in a fresh interpreter, since the plugin's replacements last for a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# After register(): which of the plugin's load-time patches are in place, and the log lines.
PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
import vllm
if len(sys.argv) > 1:
    vllm.__version__ = sys.argv[1]
import vllm_edsd
from vllm_edsd.serving.patches import PATCHES
from vllm_edsd.serving.patching import applied
vllm_edsd.register()
vllm_edsd.register()
print(json.dumps({p.name: applied(p) for p in PATCHES if p.at_load}))
"""


def start_plugin(*args: str, **env: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG", **env})
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout + out.stderr  # vLLM 0.27 logs to stdout


@pytest.mark.vllm_range
def test_every_replacement_is_logged_once():
    applied, log = start_plugin()
    assert applied["vllm.config.SpeculativeConfig.__init__"]
    assert applied["vllm.engine.arg_utils.EngineArgs.create_engine_config"]
    assert applied["vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids"]
    assert applied["vllm.v1.engine.input_processor.InputProcessor._validate_params"]
    for name, is_applied in applied.items():
        assert log.count(f"vllm-edsd: replaced {name} ") == int(is_applied), name
    assert log.count("vllm-edsd: registered the speculators model type 'edsd'") == 1
    # On CPU exactly one of the two kernel-installation hooks applies, whatever the vLLM.
    assert (
        sum(applied[n] for n in applied if n.endswith(("register_triton_kernel_overrides", "_postprocess_triton"))) == 1
    )


def test_disable_switch_leaves_vllm_untouched():
    applied, log = start_plugin(VLLM_EDSD_DISABLE="1")
    assert not any(applied.values()) and "vllm-edsd: replaced" not in log


# On a vLLM of another version: which patches are in place, and what two speculative configs
# give: an "edsd" request, and an n-gram one (which needs no model).
OUTSIDE_THE_RANGE = """
import json, sys
import vllm
vllm.__version__ = sys.argv[1]
import vllm_edsd
from vllm.config import SpeculativeConfig
from vllm_edsd.serving.patches import PATCHES, REFUSAL
from vllm_edsd.serving.patching import applied
vllm_edsd.register()
vllm_edsd.register()
outcomes = {}
for method, extra in (("edsd", {"model": "/no/such/drafter"}), ("ngram", {"prompt_lookup_max": 3})):
    try:
        outcomes[method] = SpeculativeConfig(method=method, num_speculative_tokens=2, **extra).method
    except Exception as exc:
        outcomes[method] = f"{type(exc).__name__}: {exc}"
others = [p.name for p in PATCHES if applied(p) and p is not REFUSAL]
print(json.dumps({"patches": others, "refusal": applied(REFUSAL), **outcomes}))
"""


def test_vllm_outside_the_range_refuses_edsd_by_name_and_leaves_the_rest_alone():
    out = subprocess.run([sys.executable, "-c", OUTSIDE_THE_RANGE, "0.23.0"], capture_output=True, text=True,
                         check=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG"})
    result, log = json.loads(out.stdout.strip().splitlines()[-1]), out.stdout + out.stderr
    assert result["patches"] == [] and result["refusal"]
    assert result["edsd"] == ("EDSDError: vllm-edsd supports vLLM 0.24 up to (not including) 0.34; "
                              "the installed vLLM is 0.23.0")
    assert result["ngram"] == "ngram"
    assert log.count("supports vLLM 0.24 up to (not including) 0.34; the installed vLLM is 0.23.0; the plugin "
                     "refuses \"method\": \"edsd\"") == 1


def test_an_opted_out_request_gets_its_own_prefix_cache_salt():
    """Only a cap of 0 marks a request; the mark keeps the user's own salt apart as well."""
    from vllm_edsd.serving.features.draft_length import OPTED_OUT_SALT, opted_out, salted_for_opt_out

    assert opted_out({"num_speculative_tokens": 0})
    assert not any(opted_out(extra) for extra in (None, {}, {"num_speculative_tokens": 1}, {"other": 0}))
    assert salted_for_opt_out(None) == salted_for_opt_out("") == OPTED_OUT_SALT
    assert salted_for_opt_out("tenant-a") != salted_for_opt_out("tenant-b") != OPTED_OUT_SALT
    assert "tenant-a" in salted_for_opt_out("tenant-a")
