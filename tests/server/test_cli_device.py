"""`pipeline-serve` device flags: --device, --gpu-memory-utilization, --enforce-eager and
--random-weights, as they reach the EngineConfig (no device needed: cuda is taken as given)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.cli import parse_args
from stages.text.checkpoint import load_model_config


def test_cpu_keeps_float32_and_a_fixed_kv_budget() -> None:
    _, engine = parse_args(["/m/x.gguf", "--device", "cpu"])
    assert (engine.device, engine.dtype, engine.gpu_memory_utilization) == ("cpu", "float32", None)


def test_cuda_defaults_to_bfloat16_and_sizes_the_kv_cache_from_device_memory() -> None:
    _, engine = parse_args(["/m/x.gguf", "--device", "cuda"])
    assert (engine.device, engine.dtype) == ("cuda", "bfloat16")
    assert engine.gpu_memory_utilization == 0.9 and not engine.enforce_eager
    _, engine = parse_args(
        ["/m/x.gguf", "--device", "cuda", "--gpu-memory-utilization", "0.5", "--enforce-eager"]
    )
    assert engine.gpu_memory_utilization == 0.5 and engine.enforce_eager
    assert parse_args(["/m/x", "--device", "cuda", "--dtype", "float16"])[1].dtype == "float16"


def test_kv_cache_memory_wins_over_the_utilization() -> None:
    _, engine = parse_args(
        ["/m/x.gguf", "--device", "cuda", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "8GiB"]
    )  # fmt: skip
    assert engine.gpu_memory_utilization is None and engine.kv_cache_bytes == 8 << 30


def test_on_cpu_the_utilization_is_a_share_of_available_memory_less_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's tests pass --gpu-memory-utilization whatever the device: on CPU it sizes the KV
    cache from the memory available at start, each data-parallel replica a cache of its own."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * (1 << 20))
    available = 8 << 30

    class Memory:
        pass

    memory = Memory()
    memory.available = available  # type: ignore[attr-defined]
    monkeypatch.setattr("server.cli.psutil.virtual_memory", lambda: memory)
    argv = [str(tmp_path), "--device", "cpu", "--gpu-memory-utilization", "0.5"]
    _, engine = parse_args(argv)
    assert engine.gpu_memory_utilization is None  # no device profile on CPU: a byte budget
    assert engine.kv_cache_bytes == available // 2 - (1 << 20)
    _, engine = parse_args([*argv, "--data-parallel-size", "2"])
    assert engine.kv_cache_bytes == (available // 2 - 2 * (1 << 20)) // 2
    _, engine = parse_args([*argv, "--kv-cache-memory", "1GiB"])
    assert engine.kv_cache_bytes == 1 << 30  # a size given wins, as on CUDA
    weights.write_bytes(b"\0" * (5 << 20))
    memory.available = 8 << 20  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):  # the weights leave no room
        parse_args(argv)


def test_a_q4_1_gguf_is_dequantized_on_cuda(smollm2_gguf: str) -> None:
    assert parse_args([smollm2_gguf, "--device", "cpu"])[1].quantization == "int4"
    assert parse_args([smollm2_gguf, "--device", "cuda"])[1].quantization is None


@pytest.mark.parametrize(
    "argv",
    [
        ["m", "--device", "tpu"],
        ["m", "--device", "cpu", "--gpu-memory-utilization", "1.5"],
        ["m", "--device", "cuda", "--gpu-memory-utilization", "0"],
        ["m", "--device", "cuda", "--gpu-memory-utilization", "1.5"],
        ["m", "--device", "cuda", "--gpu-memory-utilization", "nan"],
        ["m", "--device", "cuda", "--quantization", "int4"],  # CPU linears
        ["m", "--random-weights", "llama-3-8b"],  # and a MODEL
        ["--random-weights", "llama-9-zillion"],
    ],
)
def test_bad_device_flags_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_random_weights_serve_a_preset_shape_under_its_name() -> None:
    config, engine = parse_args(["--random-weights", "llama-3-8b", "--device", "cpu"])
    assert config.served_model_name == "llama-3-8b" and engine.random_weights
    shape = load_model_config(engine.model_path)
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (32, 4096, 8)
    assert engine.quantization is None


def test_random_weights_of_a_config_file(tmp_path: Path) -> None:
    raw = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    (tmp_path / "qwen-tiny").mkdir()
    (tmp_path / "qwen-tiny" / "config.json").write_text(json.dumps(raw))
    config, engine = parse_args(["--random-weights", str(tmp_path / "qwen-tiny" / "config.json")])
    assert config.served_model_name == "qwen-tiny"
    assert load_model_config(engine.model_path).architecture == "qwen2"


def test_a_draft_model_on_cuda_is_sized_from_device_memory_too(tmp_path: Path) -> None:
    """The device-memory sizing counts a draft model's weights and KV blocks (execute loads it
    with the target), so it needs no --kv-cache-memory; one given still wins."""
    spec = json.dumps(
        {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}
    )
    _, engine = parse_args(["m", "--device", "cuda", "--speculative-config", spec])
    assert engine.speculative is not None and engine.gpu_memory_utilization == 0.9
    _, engine = parse_args(
        ["m", "--device", "cuda", "--speculative-config", spec, "--kv-cache-memory", "4GiB"]
    )
    assert engine.speculative is not None and engine.gpu_memory_utilization is None
