"""Tensor parallelism on CPU with gloo: two ranks compute the logits one process computes."""

from __future__ import annotations

import multiprocessing
import socket

import numpy as np
import pytest

from gpu.memory import DeviceMemory
from gpu.runner import ModelRunner, RunnerConfig
from tests.cpu_levels import NATIVE
from tests.gpu.conftest import build_tiny_model
from tests.gpu.tp_ranks import RUNNER, agree_on_blocks, load_peak, run_rank, script

# Each case starts a group of rank processes: `make test` runs them, `make test-fast` not
pytestmark = pytest.mark.slow

SPAWN = multiprocessing.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank0_logits(path: str, steps: list, config: RunnerConfig) -> list[np.ndarray]:
    """What rank 0 of a two-rank gloo group computes for each step."""
    results = SPAWN.Queue()
    port = free_port()
    ranks = [
        SPAWN.Process(target=run_rank, args=(path, rank, 2, port, steps, results, config))
        for rank in range(2)
    ]
    for proc in ranks:
        proc.start()
    got = {rank: logits for rank, _, logits in (results.get(timeout=120) for _ in ranks)}
    for proc in ranks:
        proc.join(30)
        assert proc.exitcode == 0
    return got[0]


@pytest.mark.parametrize(
    ("arch", "kv_heads_per_rank"),
    [("llama", [1, 1]), ("qwen2", [1, 1]), ("llama_one_kv", [1, 1]), ("llama_three_kv", [1, 2])],
)
def test_two_ranks_give_the_logits_of_one(tmp_path, arch, kv_heads_per_rank):
    """Prefill, chunked prefill and decodes in mixed batches: TP=2 logits equal TP=1's within
    1e-4 in float32 (qwen2: QKV bias; llama_one_kv: its one KV head replicated on both ranks,
    and a vocabulary of 131 split 66 + 65; llama_three_kv: 3 GQA groups split 1 + 2 and 101 MLP
    columns 50 + 51)."""
    path = str(build_tiny_model(arch, tmp_path / arch, seed=3))
    runner = ModelRunner.from_path(path, RUNNER)
    vocab = runner.model_config.vocab_size
    steps = script(
        [[5, 9, 2, 7, 1, 3, 8, 4, 6], [11, 12, 13, 14, 15], list(range(20, 33))], vocab, 7, 4
    )
    expected = [runner.forward(inputs).numpy() for inputs in steps]

    results = SPAWN.Queue()
    port = free_port()
    ranks = [
        SPAWN.Process(target=run_rank, args=(path, rank, 2, port, steps, results))
        for rank in range(2)
    ]
    for proc in ranks:
        proc.start()
    got = dict(
        (rank, (heads, logits)) for rank, heads, logits in (results.get(timeout=120) for _ in ranks)
    )
    for proc in ranks:
        proc.join(30)
        assert proc.exitcode == 0
    assert [got[r][0] for r in range(2)] == kv_heads_per_rank  # each cache: its heads only
    logits = got[0][1]
    assert len(logits) == len(expected)
    for ours, theirs in zip(logits, expected, strict=True):
        assert ours.shape == theirs.shape == (ours.shape[0], vocab)
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama_three_kv"])
def test_two_ranks_with_lora_adapters_give_the_logits_of_one(tmp_path, arch):
    """Steps mixing two adapters and the base model: each rank holds its cut of every adapter
    (B's output columns of qkv and gate_up, A's input rows of o and down, whose partial updates
    join the all-reduce), and TP=2 logits equal TP=1's within 1e-4 in float32."""
    from dataclasses import replace

    from stages.lora import LoraConfig
    from tests.lora_adapters import build_peft_adapter

    base = build_tiny_model(arch, tmp_path / arch, seed=3)
    paths = {
        1: str(build_peft_adapter(base, tmp_path / "all", seed=1, rank=4, alpha=8)),
        2: str(
            build_peft_adapter(
                base, tmp_path / "mlp", seed=2, rank=2, alpha=4, targets=("up_proj", "down_proj")
            )
        ),
    }
    config = replace(RUNNER, lora=LoraConfig(max_loras=2, max_lora_rank=8))
    runner = ModelRunner.from_path(str(base), config)
    vocab = runner.model_config.vocab_size
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6], [11, 12, 13, 14, 15], list(range(20, 33))]
    adapter_of = np.array([1, 0, 2])  # the second sequence runs on the base model
    steps = []
    for inputs in script(prompts, vocab, 5, 4):
        rows = np.diff(inputs.query_start_loc)
        steps.append(
            replace(inputs, lora_ids=np.repeat(adapter_of, rows).astype(np.int64), lora_paths=paths)
        )
    expected = [runner.forward(inputs).numpy() for inputs in steps]
    plain = ModelRunner.from_path(str(base), RUNNER).forward(steps[0]).numpy()
    assert not np.allclose(plain, expected[0], atol=1e-2)  # the adapters change the logits

    for ours, theirs in zip(rank0_logits(str(base), steps, config), expected, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def _q4_gguf(tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A tiny Llama as the default model is stored: Q4_1 decoder matrices, a Q8_0 embedding
    that is also the LM head."""
    from gguf import GGMLQuantizationType as Q

    from tests.gpu.test_loader import write_gguf

    hf = build_tiny_model("llama_wide", tmp_path / "hf", seed=3)
    types = {"token_embd.weight": Q.Q8_0}
    for layer in range(2):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            types[f"blk.{layer}.{part}.weight"] = Q.Q4_1
        for part in ("ffn_gate", "ffn_up", "ffn_down"):
            types[f"blk.{layer}.{part}.weight"] = Q.Q4_1
    return write_gguf(hf, tmp_path / "tiny-q4_1.gguf", "llama", types)


# The native kernels' int8 activations; the torch path's packed int4 computes in bfloat16, whose
# rounding moves with the all-reduce's order by more than 1e-4.
@pytest.mark.skipif(not NATIVE, reason="needs the native CPU kernels")
@pytest.mark.parametrize("source", ["gguf", "safetensors"])
def test_two_ranks_of_quantized_weights_give_the_logits_of_one(tmp_path, source):
    """int4 under tensor parallelism: each rank quantizes its shard as one process quantizes the
    whole (a GGUF's own Q4_1 and Q8_0 blocks cut to the rank's rows and input blocks, or float
    weights quantized per block), so TP=2 logits equal TP=1's over prefill, chunked prefill and
    decodes, through the quantized kernels and the 8-bit LM head. Not every row to 1e-4: the
    activations go in as int8, and the all-reduce adds the row-parallel partial sums in another
    order than one process does, which can move a later int8 rounding and, with it, that row
    (on the AVX2 kernels 11 of this script's 39 rows, by up to 0.0055; on AVX-512, none). So:
    every row within 1e-2, and most within 1e-4 (a rank that quantized anything its own way
    would move every row)."""
    from dataclasses import replace

    path = (
        _q4_gguf(tmp_path)
        if source == "gguf"
        else str(build_tiny_model("llama_wide", tmp_path / "hf", seed=3))
    )
    config = replace(RUNNER, quantization="int4")
    runner = ModelRunner.from_path(path, config)
    vocab = runner.model_config.vocab_size
    steps = script(
        [[5, 9, 2, 7, 1, 3, 8, 4, 6], [11, 12, 13, 14, 15], list(range(20, 33))], vocab, 7, 4
    )
    expected = [runner.forward(inputs).numpy() for inputs in steps]
    plain = ModelRunner.from_path(path, RUNNER).forward(steps[0]).numpy()
    # Quantization shows in the logits: ranks that ran float weights would not match.
    assert not np.allclose(plain, expected[0], atol=1e-3)

    rows_equal = rows = 0
    for ours, theirs in zip(rank0_logits(path, steps, config), expected, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-2, rtol=0)
        rows_equal += int((np.abs(ours - theirs).max(axis=1) <= 1e-4).sum())
        rows += len(ours)
    assert rows_equal >= rows / 2, f"only {rows_equal} of {rows} rows equal TP=1's within 1e-4"


def test_a_shard_whose_inputs_split_a_quantization_block_is_refused_with_the_reason(tmp_path):
    """llama_three_kv's 101 MLP columns split 50 + 51: the ranks' down_proj inputs end and start
    mid-block, so they cannot hold whole blocks; the load names the projection and the cut
    before it joins any collective, and so does the engine before any stage starts. The
    ranks of llama_wide cut whole blocks."""
    from dataclasses import replace

    from gpu.tensor_parallel import TensorParallel
    from stages.config import EngineConfig
    from stages.engine import Engine
    from stages.text.checkpoint import UnsupportedModelError, quantized_shard_problem

    path = str(build_tiny_model("llama_three_kv", tmp_path / "three", seed=3))
    config = replace(RUNNER, quantization="int4")
    says = r"rank 0 takes inputs 0-50 of down_proj.*blocks of 32 weights"
    with pytest.raises(UnsupportedModelError, match=says):
        ModelRunner.from_path(path, config, TensorParallel(0, 2))
    engine = EngineConfig(model_path=path, quantization="int4", tensor_parallel_size=2)
    with pytest.raises(UnsupportedModelError, match=says + ": add --quantization none"):
        Engine(engine)
    wide = ModelRunner.from_path(str(build_tiny_model("llama_wide", tmp_path / "wide")), RUNNER)
    assert quantized_shard_problem(wide.model_config, 2) is None


def test_ranks_size_their_kv_caches_to_the_fewest_blocks_any_device_has_room_for(tmp_path):
    """--gpu-memory-utilization under tensor parallelism: each rank measures its own device (here
    the test supplies the figures) and every rank allocates the blocks of the tightest one; a
    rank without room names its own cause, and the others fail instead of waiting for it. A
    restarted group takes the count rank 0 published, on every rank."""
    mib, gib = 1 << 20, 1 << 30

    def device(free_gib: float, weights_mib: int) -> DeviceMemory:
        return DeviceMemory(
            total_bytes=gib,
            free_at_start_bytes=int(free_gib * gib),
            weights_bytes=weights_mib * mib,
            peak_step_bytes=100 * mib,
            non_torch_bytes=50 * mib,
        )

    allowed = int(0.9 * gib) // mib  # 921 blocks of 1 MiB before the weights and the rest
    figures = [
        [device(1.0, 200), device(1.0, 300)],  # rank 1 holds the larger shard
        [device(1.0, 200), device(0.5, 300)],  # rank 1's device is half taken by others
    ]
    results = SPAWN.Queue()
    port = free_port()
    ranks = [
        SPAWN.Process(
            target=agree_on_blocks,
            args=(rank, 2, port, figures, str(tmp_path), results),
        )
        for rank in range(2)
    ]
    for proc in ranks:
        proc.start()
    got = dict(results.get(timeout=120) for _ in ranks)
    for proc in ranks:
        proc.join(30)
        assert proc.exitcode == 0
    fewest = allowed - 300 - 150
    assert got[0][0] == (fewest, allowed - 200 - 150)
    assert got[1][0] == (fewest, fewest)
    assert "were free at start" in got[1][1] and "lower it" in got[1][1]
    assert "another tensor-parallel rank has no room" in got[0][1]
    assert got[0][2:] == got[1][2:] == [None, 1234]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama_one_kv", "llama_three_kv"])
def test_a_shard_loaded_alone_is_the_shard_cut_from_the_whole_model(tmp_path, arch):
    """On a device each rank loads only its slice of every checkpoint tensor (load_shard): the
    same parameters, bit for bit, as the whole model loaded and then cut (shard_model), for
    qkv bias, a replicated KV head with a padded vocabulary, and uneven GQA groups and columns."""
    import torch

    from gpu.backends import TORCH_KERNELS
    from gpu.runner import load_shard
    from gpu.tensor_parallel import TensorParallel, shard_model

    path = str(build_tiny_model(arch, tmp_path / arch, seed=3))
    config = ModelRunner.from_path(path, RUNNER).model_config
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        whole = ModelRunner.from_path(path, RUNNER).model
        cut_shape = shard_model(whole, tp)
        alone, shape = load_shard(path, config, TORCH_KERNELS, "cpu", torch.float32, tp)
        assert shape == cut_shape
        want = dict(whole.named_parameters(remove_duplicate=False))
        got = dict(alone.named_parameters(remove_duplicate=False))
        assert got.keys() == want.keys()
        for name, param in got.items():
            assert torch.equal(param, want[name]), (arch, rank, name)


def test_a_rank_loads_its_shard_without_ever_holding_the_whole_model(tmp_path):
    """A device's rank cuts every checkpoint tensor to its slice as it is read: its memory grows
    by about its shard (half the model) and one tensor, not by the whole model first."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        shapes = transformers.LlamaForCausalLM(config)
    model_bytes = sum(p.numel() * 4 for p in shapes.parameters())  # ~108 MB in float32
    checkpoint = tmp_path / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(checkpoint, safe_serialization=True)

    results = SPAWN.Queue()
    ranks = [
        SPAWN.Process(target=load_peak, args=(str(checkpoint), rank, 2, results))
        for rank in range(2)
    ]
    for proc in ranks:
        proc.start()
    got = [results.get(timeout=120) for _ in ranks]
    for proc in ranks:
        proc.join(30)
        assert proc.exitcode == 0
    for _, grew, kept in got:
        norms = 2 * 512 * 4 * 6 + 512 * 4  # every rank holds the norms whole
        assert kept == pytest.approx((model_bytes - norms) / 2 + norms, rel=0.01)
        # the shard, one tensor being cut (~4 MB) and the allocator's slack; the whole model
        # first would be twice the shard
        assert grew < 0.75 * model_bytes, (grew, model_bytes)
