"""Facts only execute knows, published for the engine and schedule in the engine's snapshot
directory: the KV block count of a cache sized from device memory, the kernel set it runs.

Each is a small text file per data-parallel replica (they share the directory), written whole
(rename) so that a reader never sees half of it. The files outlive a restarted pipeline.
"""

from __future__ import annotations

import os

from stages.config import EngineConfig

KERNELS = "kernels"  # what runs the model: a CPU kernel level, `torch` or `triton`


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
