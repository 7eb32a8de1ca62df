"""`pipeline-bench roofline`: the bytes a decode step moves by design, and its predicted time."""

from __future__ import annotations

import pytest
import torch

from perf import roofline as rl


def test_the_weights_read_a_step_are_the_models_own_less_the_embedding_table() -> None:
    # The linears read every weight once; the embedding is a lookup of a row per token.
    from gpu.model import CausalLM
    from stages.text.checkpoint import config_from_hf
    from stages.text.random_model import PRESETS

    config = config_from_hf(PRESETS["llama-3-8b"])
    with torch.device("meta"):
        model = CausalLM(config)
    read = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    step = rl.roofline("llama-3-8b", "h100", batch=1, context=2048)
    linears = next(p for p in step.parts if p.name.startswith("linears"))
    norms = (2 * config.num_layers + 1) * config.hidden_size  # the norms' weights
    assert linears.bytes - config.hidden_size * 2 == pytest.approx(2 * (read - norms), rel=1e-6)
    # Llama-3-8B's 8.03B parameters less its 0.53B-entry table, in bf16, at 3.35 TB/s.
    assert step.step_s == pytest.approx(15.0e9 / 3.35e12, rel=0.05)


def test_decode_attention_moves_the_unique_kv_once_at_batch_64() -> None:
    # The bound: at 8B, batch 64, 2k contexts on an H100, within 1.1x of the unique KV
    # bytes, where a kernel per query head moves up to 4x (Llama-3's 4 query heads a KV head).
    for bound in (2048, 8192, 131072):  # eager, and CUDA graphs captured at max_model_len
        step = rl.roofline("llama-3-8b", "h100", 64, 2048, max_model_len=bound)
        assert step.unique_kv_bytes == 64 * 2048 * 32 * 2 * 8 * 128 * 2
        assert step.attention_over_unique_kv < 1.1
        assert step.per_query_head_kv_bytes == 4 * step.unique_kv_bytes


def test_a_long_context_alone_is_split_and_its_partials_are_counted() -> None:
    short = rl.roofline("llama-3-8b", "h100", 64, 2048)
    long = rl.roofline("llama-3-8b", "h100", 1, 100_000, max_model_len=131072)
    partials = long.attention_bytes - long.unique_kv_bytes
    queries_and_outputs = 32 * 128 * 2 * 2 * 32
    assert partials > queries_and_outputs  # 8 programs (8 KV heads) cannot fill 132 SMs: split
    assert long.attention_over_unique_kv < 1.01
    assert short.attention_bytes - short.unique_kv_bytes == 64 * queries_and_outputs


def test_tensor_parallel_halves_a_ranks_bytes_and_adds_the_all_reduce() -> None:
    one = rl.roofline("llama-3-8b", "h100", 64, 2048)
    two = rl.roofline("llama-3-8b", "h100", 64, 2048, tensor_parallel=2)
    assert two.unique_kv_bytes == one.unique_kv_bytes / 2
    names = [p.name for p in two.parts]
    assert "all-reduce (NVLink)" in names and "all-reduce (NVLink)" not in [
        p.name for p in one.parts
    ]
    assert two.step_s < one.step_s


def test_a_faster_memory_gives_a_faster_memory_bound_step() -> None:
    h100 = rl.roofline("llama-3-8b", "h100", 1, 2048)
    h200 = rl.roofline("llama-3-8b", "h200", 1, 2048)
    assert h200.step_s / h100.step_s == pytest.approx(3.35 / 4.8, rel=0.01)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu": "v100"}, "unknown GPU"),
        ({"model": "gpt-5"}, "unknown model"),
        ({"batch": 0}, "at least 1"),
        ({"tensor_parallel": 3}, "does not shard"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    args = {"model": "llama-3-8b", "gpu": "h100", "batch": 1, "context": 2048} | kwargs
    with pytest.raises(ValueError, match=message):
        rl.roofline(**args)


def test_the_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from perf.cli import main

    assert main(["roofline", "--batch", "64", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "decode attention moves 1.00" in out and "output tok/s" in out
