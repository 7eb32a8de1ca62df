"""Facts a stage knows, published for the engine and the other stages in the engine's snapshot
directory: execute's KV block count of a cache sized from device memory and the kernel set it
runs; schedule's running and waiting requests' LoRA adapters (vLLM's lora_requests_info).

Each is a small text file per data-parallel replica (they share the directory), written whole
(rename) so that a reader never sees half of it. The files outlive a restarted pipeline.
"""

from __future__ import annotations

import json
import os
import time

from stages.config import EngineConfig

KERNELS = "kernels"  # what runs the model: a CPU kernel level, `torch` or `triton`
LORA_REQUESTS = "lora_requests"


def _path(config: EngineConfig, name: str) -> str:
    return os.path.join(config.snapshot_dir, f"{name}.dp{config.data_parallel_rank}")


def publish(config: EngineConfig, name: str, text: str) -> None:
    path = _path(config, name)
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def published(config: EngineConfig, name: str) -> str | None:
    try:
        with open(_path(config, name), encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def publish_lora_requests(
    config: EngineConfig, max_loras: int, running: list[str], waiting: list[str]
) -> None:
    """The adapters of the running and the waiting requests, by name, and when they were so."""
    record = {"max_lora": max_loras, "running": running, "waiting": waiting, "at": time.time()}
    publish(config, LORA_REQUESTS, json.dumps(record))


def lora_requests_info(config: EngineConfig) -> tuple[str, float] | None:
    """vLLM's lora_requests_info as a labelled stats key (label values quoted: the adapter lists
    are comma-separated) and its value, the wall-clock time they were last so; None before
    schedule has published them."""
    text = published(config, LORA_REQUESTS)
    if text is None:
        return None
    record = json.loads(text)
    labels = {
        "max_lora": str(record["max_lora"]),
        "running_lora_adapters": ",".join(record["running"]),
        "waiting_lora_adapters": ",".join(record["waiting"]),
    }
    quoted = ",".join(f"{k}={json.dumps(v)}" for k, v in labels.items())
    return f"lora_requests_info{{{quoted}}}", float(record["at"])
