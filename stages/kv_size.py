"""The KV block count of a cache sized from device memory (--gpu-memory-utilization).

Only execute can size it (it loads the weights and profiles a step), so it publishes the count
(stages/published.py), which schedule waits for and the engine reads. A later execute allocates
the published count, so that every schedule it meets plans the same blocks.
"""

from __future__ import annotations

import time

from stages.config import EngineConfig, num_kv_blocks, sized_from_device_memory
from stages.published import publish, published

_NAME = "kv_blocks"
_POLL_S = 0.05


def publish_num_blocks(config: EngineConfig, num_blocks: int) -> None:
    publish(config, _NAME, str(num_blocks))


def published_num_blocks(config: EngineConfig) -> int | None:
    text = published(config, _NAME)
    return None if text is None else int(text)


def planned_num_blocks(config: EngineConfig, timeout_s: float) -> int:
    """The blocks schedule hands out: --kv-cache-memory's, or those execute published (waited
    for up to `timeout_s`; TimeoutError after)."""
    if not sized_from_device_memory(config):
        return num_kv_blocks(config)
    if not config.snapshot_dir:
        raise ValueError("a KV cache sized from device memory needs the engine's snapshot dir")
    deadline = time.monotonic() + timeout_s
    while (blocks := published_num_blocks(config)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"execute published no KV block count within {timeout_s:g} s")
        time.sleep(_POLL_S)
    return blocks
