"""A drafter that vLLM resolves itself: ``"model"`` a model hub id, not a local directory. The
plugin leaves the download to vLLM (``serving/preflight.py``: with the hub switched off, vLLM
loads what its cache holds) and checks what vLLM loaded against the target afterwards
(``serving/request.py``). A hub cache made here stands in for the hub: no network."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.drafters import edited_copy, edsd_spec, engine_config
from support.toy import make_drafter

from vllm_edsd.errors import EDSDError

REPO = "someone/edsd-drafter"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, the hub switched off: ``snapshot(hub, drafter)`` puts a drafter
    directory in it as ``REPO``'s main revision, the layout huggingface_hub writes."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def snapshot(hub: Path, drafter) -> None:
    repo = hub / f"models--{REPO.replace('/', '--')}"
    edited_copy(drafter, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def test_a_hub_drafter_resolves_to_vllms_eagle3_path(models, hub):
    snapshot(hub, models["llama-edsd"])
    spec = engine_config(models["llama"], edsd_spec(REPO)).speculative_config
    assert spec.method == "eagle3" and spec.draft_model_config.model == REPO
    assert spec.draft_model_config.architectures == ["Eagle3EDSDLlamaForCausalLM"]
    assert spec.num_speculative_tokens == 4


def test_a_hub_drafter_for_another_target_is_refused(models, hub, tmp_path):
    make_drafter(models["llama-narrow"], tmp_path / "narrow-drafter", draft_vocab_size=256)
    snapshot(hub, tmp_path / "narrow-drafter")
    with pytest.raises(EDSDError, match=f"^EDSD drafter {REPO} .*hidden"):
        engine_config(models["llama"], edsd_spec(REPO))


def test_a_hub_model_that_is_no_edsd_drafter_is_refused(models, hub):
    snapshot(hub, models["llama"])
    # the architectures named are the ones vLLM's EAGLE-3 path rewrote the config to
    rewritten = r"\(architectures=\['Eagle3LlamaForCausalLM'\]\)"
    with pytest.raises(EDSDError, match=rf"^{REPO}: not an EDSD drafter {rewritten}$"):
        engine_config(models["llama"], edsd_spec(REPO))


def test_a_hub_id_missing_from_the_cache_is_one_line(models, hub):
    with pytest.raises(EDSDError, match=f"no such local directory: .*/{REPO}$"):
        engine_config(models["llama"], edsd_spec(REPO))
