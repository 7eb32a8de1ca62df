"""The paged model against transformers on the same weights, over mixed prefill/decode batches."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from gpu import native
from gpu.attention import AttentionInputs
from gpu.backends import NATIVE_KERNELS, TORCH_KERNELS, Kernels
from gpu.kv_cache import KVCache
from gpu.loader import iter_weights
from gpu.model import CausalLM
from stages.text.checkpoint import load_model_config
from tests.cpu_levels import NATIVE_LEVELS
from tests.gpu.paged import BlockPool, PagedSequence, StepBatch, build_step

BLOCK_SIZE = 4


def load_ours(path, kernels: Kernels = TORCH_KERNELS) -> CausalLM:
    config = load_model_config(str(path))
    model = CausalLM(config, kernels).eval()
    model.load_weights(iter_weights(str(path), config, torch.float32))
    return model


def reference_logits(path, token_ids: list[int]) -> torch.Tensor:  # -> [L, vocab]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def run_step(model: CausalLM, cache: KVCache, step: StepBatch) -> torch.Tensor:  # -> [T, vocab]
    inputs = AttentionInputs(
        query_start_loc=torch.from_numpy(step.query_start_loc),
        context_lens=torch.from_numpy(step.context_lens),
        block_tables=torch.from_numpy(step.block_tables),
        slot_mapping=torch.from_numpy(step.slot_mapping),
    )
    with torch.inference_mode():
        return model(
            torch.from_numpy(step.input_ids),
            torch.from_numpy(step.positions),
            cache.layers,
            inputs,
            torch.arange(len(step.input_ids)),
        )


# Each step lists (sequence index, new tokens): whole prefills, chunked prefills, and decodes.
SCHEDULE = [
    [(0, 21), (1, 16)],
    [(0, 1), (1, 9), (2, 11)],
    [(0, 1), (1, 1), (2, 1)],
    [(2, 1), (0, 1), (1, 1)],
]


@pytest.fixture(params=["torch", *NATIVE_LEVELS])
def kernels(request) -> Iterator[Kernels]:
    """The torch path, and the native kernels at every level this host runs."""
    if request.param == "torch":
        yield TORCH_KERNELS
        return
    with native.using_level(request.param):
        yield NATIVE_KERNELS


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2", "mistral", "mistral_swa"])
def test_mixed_paged_batches_match_transformers(tiny_models, arch, kernels):
    path = tiny_models[arch]
    model = load_ours(path, kernels)
    rng = np.random.default_rng(1)
    totals = [sum(n for step in SCHEDULE for s, n in step if s == i) for i in range(3)]
    seqs = [PagedSequence(rng.integers(0, model.config.vocab_size, n).tolist()) for n in totals]
    pool = BlockPool(num_blocks=64, block_size=BLOCK_SIZE, seed=3)
    cache = KVCache(model.config, num_blocks=64, block_size=BLOCK_SIZE)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for schedule in SCHEDULE:
        step = build_step(pool, [(seqs[i], n) for i, n in schedule])
        logits = run_step(model, cache, step)
        for row, (i, _) in enumerate(schedule):
            got[i].append(logits[step.query_start_loc[row] : step.query_start_loc[row + 1]])
    for seq, pieces in zip(seqs, got, strict=True):
        expected = reference_logits(path, seq.token_ids)
        ours = torch.cat(pieces)
        scale = expected.abs().max().item()
        assert (ours - expected).abs().max().item() < 1e-4 * max(1.0, scale)


def test_batch_gives_each_sequence_what_it_gets_alone(tiny_models, kernels):
    model = load_ours(tiny_models["qwen2"], kernels)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, n).tolist() for n in (5, 13, 8)]

    def run(indices: list[int]) -> dict[int, torch.Tensor]:
        pool = BlockPool(num_blocks=32, block_size=BLOCK_SIZE, seed=len(indices))
        cache = KVCache(model.config, num_blocks=32, block_size=BLOCK_SIZE)
        seqs = {i: PagedSequence([*prompts[i], 7, 9]) for i in indices}
        out = {i: [] for i in indices}
        for chunk in ([len(prompts[i]) for i in indices], [1] * len(indices), [1] * len(indices)):
            step = build_step(pool, [(seqs[i], n) for i, n in zip(indices, chunk, strict=True)])
            logits = run_step(model, cache, step)
            for row, i in enumerate(indices):
                out[i].append(logits[step.query_start_loc[row + 1] - 1])
        return {i: torch.stack(v) for i, v in out.items()}

    together = run([0, 1, 2])
    for i in range(3):
        alone = run([i])[i]
        torch.testing.assert_close(together[i], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
def test_triton_attention_backend_matches_the_torch_path(tiny_models):
    from gpu.backends import triton_kernels

    path = tiny_models["mistral_swa"]
    config = load_model_config(str(path))
    triton_model = load_ours(path, triton_kernels())
    torch_model = load_ours(path)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 128, n).tolist() for n in (9, 3)]
    outputs = []
    for model in (torch_model, triton_model):
        seqs = [PagedSequence(list(p)) for p in prompts]
        pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE, seed=5)
        cache = KVCache(config, num_blocks=16, block_size=BLOCK_SIZE)
        mixed = run_step(model, cache, build_step(pool, [(seqs[0], 9), (seqs[1], 2)]))
        decode = run_step(model, cache, build_step(pool, [(seqs[1], 1)]))
        outputs.append(torch.cat([mixed, decode]))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
def test_an_angle_table_gives_the_same_logits_and_a_step_computes_no_angle(
    tiny_models, monkeypatch
):
    """#33 item 8: with the model's table of every position (as the runner makes on CUDA), the
    Triton rotary reads it by position; the logits are those of a step's own angles, bit for
    bit, and no layer computes an angle."""
    from gpu import backends

    path = tiny_models["llama"]
    config = load_model_config(str(path))
    model = load_ours(path, backends.triton_kernels())
    prompt = np.random.default_rng(7).integers(0, 128, 11).tolist()

    def prefill_and_decode() -> torch.Tensor:
        seq = PagedSequence(list(prompt))
        pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE, seed=5)
        cache = KVCache(config, num_blocks=16, block_size=BLOCK_SIZE)
        prefill = run_step(model, cache, build_step(pool, [(seq, 10)]))
        return torch.cat([prefill, run_step(model, cache, build_step(pool, [(seq, 1)]))])

    own = prefill_and_decode()
    model.set_angle_table(64)
    assert model.angle_table is not None and model.angle_table.shape == (64, 2 * 8)

    def no_angles(*_: object) -> None:
        raise AssertionError("a step computed its angles beside the model's table")

    monkeypatch.setattr(backends, "rope_angles", no_angles)
    assert torch.equal(prefill_and_decode(), own)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
def test_an_fp8_kv_cache_keeps_the_logits_near_and_calculates_its_scales(tiny_models):
    from gpu.backends import triton_kernels
    from gpu.kv_cache import FP8, K_SCALE_CONSTANT

    path = tiny_models["llama"]
    config = load_model_config(str(path))
    model = load_ours(path, triton_kernels())
    prompt = np.random.default_rng(6).integers(0, 128, 11).tolist()
    outputs = {}
    for name, dtype, calculate in (
        ("fp32", torch.float32, False),
        ("fp8", FP8, False),
        ("fp8 calculated", FP8, True),
    ):
        seq = PagedSequence(list(prompt))
        pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE, seed=5)
        cache = KVCache(config, num_blocks=16, block_size=BLOCK_SIZE, dtype=dtype)
        if calculate:
            cache.calculate_scales_on_next_write()
        prefill = run_step(model, cache, build_step(pool, [(seq, 10)]))
        decode = run_step(model, cache, build_step(pool, [(seq, 1)]))
        outputs[name] = torch.cat([prefill[-1:], decode])
        if dtype == FP8:
            scales = [layer.scales[0].item() for layer in cache.layers]
            assert not any(layer.calculate_scales for layer in cache.layers)
            if calculate:  # set from the prompt's keys, once: not 1.0, each layer its own
                assert all(0 < s != 1.0 for s in scales) and len(set(scales)) == len(scales)
                k_max = max(cache.layers[0][0].float().abs().max().item(), 1e-30)
                # The prompt's largest key is stored near 200 (then rounded to e4m3's step of 16
                # there; the decoded token's may go a little past it).
                assert K_SCALE_CONSTANT * 0.9 <= k_max <= K_SCALE_CONSTANT * 1.3
            else:
                assert scales == [1.0] * len(scales)
    for name in ("fp8", "fp8 calculated"):
        # e4m3 keeps 3 mantissa bits: near the float32 cache's logits, not equal.
        torch.testing.assert_close(outputs[name], outputs["fp32"], rtol=0.1, atol=0.1)
        assert not torch.equal(outputs[name], outputs["fp32"])
    assert outputs["fp8"].argmax(-1).tolist() == outputs["fp32"].argmax(-1).tolist()
