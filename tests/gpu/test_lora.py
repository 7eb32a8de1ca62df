"""LoRA adapters in the model: one step mixing three adapters and the base model gives each row
the logits of its PEFT-merged model; the update rides on any base kernel; slots and their LRU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.kv_cache import KVCache
from gpu.lora import LoraLinear, LoraSlots, install_lora
from gpu.model import CausalLM
from stages.lora import LoraConfig, LoraError
from tests.cpu_levels import NATIVE
from tests.gpu.paged import BlockPool, PagedSequence, build_step
from tests.gpu.test_model import load_ours, run_step
from tests.lora_adapters import build_peft_adapter, merged_logits

# With a compiler on the machine the native kernels must build: a build error fails, not skips.
needs_gcc = pytest.mark.skipif(
    not NATIVE, reason="needs a C compiler and PIPELINE_SERVE_NATIVE other than 0"
)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Three adapters per base model: all projections (rank 8), attention only with rsLoRA
    (rank 4), MLP only (rank 2)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for arch in ("llama", "qwen2"):
        base = tiny_models[arch]
        made[arch] = [
            build_peft_adapter(base, root / f"{arch}-all", seed=1, rank=8, alpha=16),
            build_peft_adapter(
                base,
                root / f"{arch}-attn",
                seed=2,
                rank=4,
                alpha=8,
                targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                use_rslora=True,
            ),
            build_peft_adapter(
                base,
                root / f"{arch}-mlp",
                seed=3,
                rank=2,
                alpha=4,
                targets=("gate_proj", "down_proj"),
            ),
        ]
    return made


def _paths(adapter_dirs) -> dict[int, str]:
    return {i + 1: str(d) for i, d in enumerate(adapter_dirs)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_step_mixing_three_adapters_and_base_matches_peft_merged(tiny_models, adapters, arch):
    base = tiny_models[arch]
    model = load_ours(base)
    slots = install_lora(model, LoraConfig(max_loras=3, max_lora_rank=8), torch.device("cpu"))
    cache = KVCache.from_budget(model.config, 1 << 20, 4, torch.float32, "cpu")
    pool = BlockPool(cache.num_blocks, 4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (9, 6, 11, 7)]
    lora_of_row = np.array([2, 0, 3, 1])  # the base model's row among the adapters'
    seqs = [PagedSequence(list(p)) for p in prompts]
    paths = _paths(adapters[arch])
    # A prefill of every row, then two decode steps; logits of every position are checked.
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    decode = [rng.integers(0, 128, size=2).tolist() for _ in seqs]
    for step_index in range(3):
        if step_index:
            for seq, extra in zip(seqs, decode, strict=True):
                seq.token_ids.append(extra[step_index - 1])
        chunks = [(s, len(s.token_ids) - s.num_cached) for s in seqs]
        step = build_step(pool, chunks)
        slots.begin(np.repeat(lora_of_row, [n for _, n in chunks]), paths)
        logits = run_step(model, cache, step)
        slots.end()
        at = 0
        for row, (_, n) in enumerate(chunks):
            got[row].append(logits[at : at + n])
            at += n
    for row, seq in enumerate(seqs):
        lora_id = int(lora_of_row[row])
        adapter = adapters[arch][lora_id - 1] if lora_id else None
        expected = merged_logits(base, adapter, seq.token_ids)
        ours = torch.cat(got[row])
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
        if adapter is not None:  # the adapter matters: the base's logits are far from these
            assert (merged_logits(base, None, seq.token_ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lora_dtype_holds_the_adapters_in_it_and_still_applies_them(tiny_models, adapters, dtype):
    """--lora-dtype (vLLM's): the slots are in that dtype on a float32 model, and the adapted
    logits stay as close to PEFT's merged model as that dtype's rounding allows."""
    base = tiny_models["llama"]
    model = load_ours(base)
    config = LoraConfig(max_loras=1, max_lora_rank=8, dtype=dtype)
    slots = install_lora(model, config, torch.device("cpu"))
    assert {a.dtype for a in slots.a.values()} == {getattr(torch, dtype)}
    cache = KVCache.from_budget(model.config, 1 << 20, 4, torch.float32, "cpu")
    pool = BlockPool(cache.num_blocks, 4)
    seq = PagedSequence(np.random.default_rng(1).integers(0, 128, size=9).tolist())
    step = build_step(pool, [(seq, len(seq.token_ids))])
    slots.begin(np.ones(len(seq.token_ids), np.int64), {1: str(adapters["llama"][0])})
    logits = run_step(model, cache, step)
    slots.end()
    expected = merged_logits(base, adapters["llama"][0], seq.token_ids)
    torch.testing.assert_close(logits, expected, rtol=0, atol=5e-2)
    assert (merged_logits(base, None, seq.token_ids) - expected).abs().max() > 1e-1


@needs_gcc
def test_update_rides_on_the_native_int4_kernel(tiny_models, adapters):
    """A projection on the GGUF Q4_1 kernel gets the same low-rank update as a dense one."""
    from gpu import native
    from gpu.quant import NativeQ4Linear

    assert native.available(), "with a C compiler the native kernels must build"
    model = load_ours(tiny_models["llama"])
    slots = LoraSlots(
        model.config, LoraConfig(max_loras=2, max_lora_rank=8), torch.float32, torch.device("cpu")
    )
    dense = model.model.layers[1].mlp.gate_up_proj
    quantized = NativeQ4Linear.from_float(dense.weight.detach())
    key = (1, "gate_up_proj")
    x = torch.randn(5, model.config.hidden_size)
    slots.begin(np.array([1, 0, 2, 1, 0]), _paths(adapters["llama"]))
    with torch.inference_mode():
        dense_delta = LoraLinear(dense, slots, key)(x) - dense(x)
        q4_delta = LoraLinear(quantized, slots, key)(x) - quantized(x)
    slots.end()
    torch.testing.assert_close(q4_delta, dense_delta, rtol=1e-4, atol=1e-4)
    assert dense_delta[[1, 4]].abs().max() == 0  # base rows get nothing
    assert dense_delta[[0, 2, 3]].abs().min(dim=1).values.max() > 0


def test_slots_evict_least_recently_used_and_host_cache_keeps_max_cpu_loras(tiny_models, adapters):
    model: CausalLM = load_ours(tiny_models["llama"])
    config = LoraConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    slots = LoraSlots(model.config, config, torch.float32, torch.device("cpu"))
    paths = _paths(adapters["llama"])
    for lora_ids in ([1], [2], [1], [3]):  # 3 evicts 2, the least recently used
        slots.begin(np.array(lora_ids), paths)
        slots.end()
    assert slots.slot_of == {1: 0, 3: 1}
    assert list(slots.host) == [1, 3]  # 2 fell out of the host LRU too
    with pytest.raises(RuntimeError, match="max-loras"):
        slots.begin(np.array([1, 2, 3]), paths)


def test_slot_reuse_clears_the_previous_adapter(tiny_models, adapters):
    """An adapter placed where another was must not keep that one's projections it lacks."""
    base = tiny_models["llama"]
    model = load_ours(base)
    slots = install_lora(model, LoraConfig(max_loras=1, max_lora_rank=8), torch.device("cpu"))
    paths = _paths(adapters["llama"])
    cache = KVCache.from_budget(model.config, 1 << 20, 4, torch.float32, "cpu")
    tokens = list(range(5, 14))
    for lora_id in (1, 3):  # all projections, then MLP only into the same slot
        pool = BlockPool(cache.num_blocks, 4)
        seq = PagedSequence(list(tokens))
        step = build_step(pool, [(seq, len(tokens))])
        slots.begin(np.full(len(tokens), lora_id), paths)
        logits = run_step(model, cache, step)
        slots.end()
    expected = merged_logits(base, adapters["llama"][2], tokens)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_an_adapter_gone_from_disk_since_it_was_checked_is_refused_at_load(
    tiny_models, adapters, tmp_path
):
    model = load_ours(tiny_models["llama"])
    slots = LoraSlots(
        model.config, LoraConfig(max_loras=1, max_lora_rank=8), torch.float32, torch.device("cpu")
    )
    with pytest.raises(LoraError, match="No adapter found"):
        slots.begin(np.array([7]), {7: str(tmp_path)})


@needs_gcc
@pytest.mark.parametrize("decode_steps", [0, 2])
def test_adapter_rows_stay_on_the_fused_native_layers_with_the_per_op_paths_logits(
    tiny_models, adapters, monkeypatch, decode_steps
):
    """On GGUF-style int4 weights a step mixing three adapters and the base runs the fused C
    layers, which add each row's update in the same call: every row gets the logits of the
    per-op path (LoraLinear around each projection), prefill chunks and decode-only steps."""
    from gpu import native
    from gpu.backends import NATIVE_KERNELS
    from gpu.loader import iter_weights
    from gpu.quantize import quantize_linears
    from stages.text.checkpoint import load_model_config

    assert native.available(), "with a C compiler the native kernels must build"
    calls = {"fused": 0}
    for name in ("q4_layer_attn_in", "q4_decode_layer"):
        original = getattr(native, name)

        def counted(*args, original=original):
            calls["fused"] += 1
            return original(*args)

        monkeypatch.setattr(native, name, counted)
    path = str(tiny_models["llama"])
    config = load_model_config(path)
    model = CausalLM(config, NATIVE_KERNELS).eval()
    model.load_weights(iter_weights(path, config, torch.float32))
    quantize_linears(model, "int4", max_thin_rows=48)
    fused = model.fused_layers
    assert fused is not None
    slots = install_lora(model, LoraConfig(max_loras=3, max_lora_rank=8), torch.device("cpu"))
    assert fused.lora is slots
    paths = _paths(adapters["llama"])
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (7, 5, 9, 6, 4)]
    lora_of_row = np.array([3, 0, 1, 2, 1])
    extra = rng.integers(0, 128, size=(decode_steps, len(prompts))).tolist()

    def run(on_fused: bool, lora_ids: np.ndarray = lora_of_row) -> list[torch.Tensor]:
        """The logits of every step."""
        model.fused_layers = fused if on_fused else None
        cache = KVCache.from_budget(config, 1 << 20, 4, torch.float32, "cpu")
        pool = BlockPool(cache.num_blocks, 4)
        seqs = [PagedSequence(list(p)) for p in prompts]
        out = []
        for step_index in range(decode_steps + 1):
            if step_index:
                for seq, tokens in zip(seqs, extra[step_index - 1], strict=True):
                    seq.token_ids.append(tokens)
            chunks = [(s, len(s.token_ids) - s.num_cached) for s in seqs]
            step = build_step(pool, chunks)
            slots.begin(np.repeat(lora_ids, [n for _, n in chunks]), paths)
            out.append(run_step(model, cache, step))
            slots.end()
        return out

    per_op = run(on_fused=False)
    assert calls["fused"] == 0
    on_fused = run(on_fused=True)
    assert calls["fused"] == config.num_layers * (decode_steps + 1)
    for ours, expected in zip(on_fused, per_op, strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    # The adapters matter: the base model's logits are far from the adapter rows' and equal to
    # the base row's.
    base = run(on_fused=True, lora_ids=np.zeros_like(lora_of_row))
    last = torch.from_numpy(np.cumsum([len(p) for p in prompts]) - 1)  # each prompt's end
    final = on_fused[-1] if decode_steps else on_fused[-1][last]
    final_base = base[-1] if decode_steps else base[-1][last]
    torch.testing.assert_close(final[1], final_base[1], rtol=1e-5, atol=1e-5)
    for row in (0, 2, 3, 4):
        assert (final[row] - final_base[row]).abs().max() > 1e-2
