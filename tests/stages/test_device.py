"""--device resolution and the CUDA device of each replica and rank (stages/device.py), and the KV
block count execute publishes when it sizes the cache from device memory (stages/kv_size.py)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from stages.config import EngineConfig, num_kv_blocks
from stages.device import cuda_placement, default_dtype, resolve_device
from stages.kv_size import planned_num_blocks, publish_num_blocks, published_num_blocks


def test_auto_is_cuda_exactly_when_torch_sees_a_device():
    assert resolve_device("auto", sees_cuda=lambda: True) == "cuda"
    assert resolve_device("auto", sees_cuda=lambda: False) == "cpu"


def test_an_explicit_device_is_taken_without_probing():
    def probe() -> bool:
        raise AssertionError("probed")

    assert resolve_device("cpu", sees_cuda=probe) == "cpu"
    assert resolve_device("cuda", sees_cuda=probe) == "cuda"
    with pytest.raises(ValueError, match="tpu"):
        resolve_device("tpu", sees_cuda=probe)


def test_bfloat16_is_the_default_dtype_on_cuda_only():
    assert default_dtype("cuda") == "bfloat16"
    assert default_dtype("cpu") == "float32"


def test_replica_r_rank_k_holds_visible_device_r_times_tp_plus_k():
    visible = "2,3,5,7"
    held = [
        (r, k, cuda_placement(r, k, 2, visible, device_count=4)) for r in range(2) for k in range(2)
    ]
    assert [(p.index, p.visible_id) for _, _, p in held] == [
        (0, "2"),
        (1, "3"),
        (2, "5"),
        (3, "7"),
    ]
    assert held[3][2].torch_device == "cuda:3"


def test_without_cuda_visible_devices_every_device_counts_in_order():
    placement = cuda_placement(1, 0, 1, None, device_count=2)
    assert (placement.index, placement.visible_id) == (1, "1")
    uuids = cuda_placement(0, 1, 2, "GPU-aaa, GPU-bbb", device_count=2)
    assert uuids.visible_id == "GPU-bbb"


def test_a_group_larger_than_the_visible_devices_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs CUDA device 2, but only 2 are visible"):
        cuda_placement(1, 0, 2, "0,1", device_count=8)
    with pytest.raises(ValueError, match="only 1 are visible"):
        cuda_placement(0, 1, 2, None, device_count=1)
    with pytest.raises(ValueError, match="no rank 2"):
        cuda_placement(0, 2, 2, None, device_count=4)


def test_schedule_waits_for_the_count_execute_publishes(tmp_path, tiny_chat_model):
    config = EngineConfig(
        model_path=tiny_chat_model, gpu_memory_utilization=0.9, snapshot_dir=str(tmp_path)
    )
    assert published_num_blocks(config) is None
    publisher = threading.Timer(0.2, publish_num_blocks, (config, 1234))
    publisher.start()
    started = time.monotonic()
    assert planned_num_blocks(config, timeout_s=30) == 1234
    assert time.monotonic() - started >= 0.15
    publisher.join()
    # Another data-parallel replica sharing the snapshot directory sizes its own device.
    other = dataclasses.replace(config, data_parallel_rank=1)
    assert published_num_blocks(other) is None


def test_no_published_count_in_time_is_a_timeout(tmp_path, tiny_chat_model):
    config = EngineConfig(
        model_path=tiny_chat_model, gpu_memory_utilization=0.9, snapshot_dir=str(tmp_path)
    )
    with pytest.raises(TimeoutError, match="no KV block count"):
        planned_num_blocks(config, timeout_s=0.1)


def test_a_fixed_kv_budget_is_planned_without_waiting(tmp_path, tiny_chat_model):
    config = EngineConfig(model_path=tiny_chat_model, kv_cache_bytes=1 << 20)
    assert planned_num_blocks(config, timeout_s=0) == num_kv_blocks(config)
