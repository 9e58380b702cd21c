"""vLLM's hidden-states connector for a KV cache in host memory (docs/scale.md, "Features").

vLLM's ``ExampleHiddenStatesConnector`` writes what the ``extract_hidden_states`` method
cached through a CUDA copy stream into pinned memory; vLLM's CPU build has neither, and its
worker dies at the first finished request ("pin_memory=True requires a CUDA or other
accelerator backend"). Where the cache is in host memory this subclass copies and writes
each request's hidden states at once; on a GPU it is vLLM's connector unchanged. vLLM loads
it by name (``kv_connector_module_path``), in the worker and the scheduler processes. The
method it overrides and the connector's private state it uses are rows of ``PATCHES``
(vllm_edsd/serving/patches.py).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """Stands for the CUDA event vLLM's connector polls: the write has already happened."""

    @staticmethod
    def query() -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` that also runs where the KV cache is host memory."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            lock = self._lock_fds.pop(pending.req_id, None)
            if lock is not None:
                os.close(lock)  # releases the reader waiting on the file's lock
        self._req_copy_events[pending.req_id] = _Written()
