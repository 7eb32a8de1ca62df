"""The KV block count of a cache sized from device memory (--gpu-memory-utilization).

Only execute can size it (it loads the weights and profiles a step), so it publishes the count
in the engine's snapshot directory, where schedule waits for it and the engine reads it. The file
outlives a restarted pipeline: a later execute allocates the published count, so that every
schedule it meets plans the same blocks.
"""

from __future__ import annotations

import os
import time

from stages.config import EngineConfig, num_kv_blocks, sized_from_device_memory

_FILE = "kv_blocks"
_POLL_S = 0.05


def _path(config: EngineConfig) -> str:
    # Data-parallel replicas share the snapshot directory; each sizes its own device.
    return os.path.join(config.snapshot_dir, f"{_FILE}.dp{config.data_parallel_rank}")


def publish_num_blocks(config: EngineConfig, num_blocks: int) -> None:
    """Write the count whole (rename), so that a reader never sees half of it."""
    path = _path(config)
    with open(f"{path}.tmp", "w", encoding="ascii") as f:
        f.write(str(num_blocks))
    os.replace(f"{path}.tmp", path)


def published_num_blocks(config: EngineConfig) -> int | None:
    try:
        with open(_path(config), encoding="ascii") as f:
            return int(f.read())
    except FileNotFoundError:
        return None


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
