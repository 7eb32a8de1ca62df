"""ModelRunner.step on numpy batches: greedy generation, chunked prefill, logprobs, seeds, state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch

from gpu.runner import ModelRunner, RunnerConfig, StepBatch, StepOutput
from gpu.sampler import SamplingArrays
from tests.gpu.paged import BlockPool, PagedSequence, build_step


@dataclass
class Request:
    handle: int
    prompt: list[int]
    max_new_tokens: int
    sampling: dict = field(default_factory=dict)  # SamplingArrays field -> scalar or id list
    prompt_logprobs: int = -1
    seq: PagedSequence = field(init=False)
    outputs: list[int] = field(default_factory=list)
    results: list[StepOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seq = PagedSequence(list(self.prompt))


def sampling_rows(requests: list[Request]) -> SamplingArrays:
    params = SamplingArrays.defaults(len(requests))
    fields = {}
    for name in SamplingArrays.__slots__:
        base = getattr(params, name)
        values = [r.sampling.get(name) for r in requests]
        if all(v is None for v in values):
            continue
        if base.ndim == 1:
            fields[name] = np.array(
                [base[i] if v is None else v for i, v in enumerate(values)], dtype=base.dtype
            )
        else:
            width = max(len(v or []) for v in values)
            pad = 0.0 if name == "logit_bias_values" else -1
            fields[name] = np.array(
                [list(v or []) + [pad] * (width - len(v or [])) for v in values], dtype=base.dtype
            )
    return replace(params, **fields)


def generate(
    runner: ModelRunner, requests: list[Request], chunk_tokens: int = 7, seed: int = 0
) -> None:
    """Greedy-schedule everyone: prefill in chunks of at most chunk_tokens, then decode."""
    pool = BlockPool(runner.num_kv_blocks, runner.kv_cache.block_size, seed=seed)
    while any(len(r.outputs) < r.max_new_tokens for r in requests):
        live = [r for r in requests if len(r.outputs) < r.max_new_tokens]
        chunks = [(r, min(chunk_tokens, len(r.seq.token_ids) - r.seq.num_cached)) for r in live]
        step = build_step(pool, [(r.seq, n) for r, n in chunks])
        samples = np.array([r.seq.num_cached >= len(r.prompt) for r, _ in chunks])
        batch = StepBatch(
            handles=np.array([r.handle for r in live], np.int64),
            input_ids=step.input_ids,
            positions=step.positions,
            query_start_loc=step.query_start_loc,
            context_lens=step.context_lens,
            block_tables=step.block_tables,
            slot_mapping=step.slot_mapping,
            prompt_lens=np.array([len(r.prompt) for r in live], np.int32),
            sample=samples,
            sampling=sampling_rows(live),
            prompt_logprobs=np.array([r.prompt_logprobs for r in live], np.int32),
        )
        out = runner.step(batch)
        for row, (r, _) in enumerate(chunks):
            r.results.append(_row(out, row))
            if samples[row]:
                token = int(out.token_ids[row])
                r.outputs.append(token)
                r.seq.token_ids.append(token)
            else:
                assert out.token_ids[row] == -1


def _row(out: StepOutput, row: int) -> dict:
    lo, hi = out.prompt_logprob_start_loc[row], out.prompt_logprob_start_loc[row + 1]
    return dict(
        token=int(out.token_ids[row]),
        logprob=float(out.logprobs[row]),
        rank=int(out.ranks[row]),
        top_ids=out.top_ids[row].tolist(),
        top_logprobs=out.top_logprobs[row].tolist(),
        prompt_positions=out.prompt_positions[lo:hi].tolist(),
        prompt_tokens=out.prompt_token_ids[lo:hi].tolist(),
        prompt_logprobs=out.prompt_token_logprobs[lo:hi].tolist(),
        prompt_ranks=out.prompt_ranks[lo:hi].tolist(),
        prompt_top_ids=out.prompt_top_ids[lo:hi].tolist(),
    )


def hf_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def llama_runner(tiny_models) -> ModelRunner:
    return ModelRunner.from_path(
        str(tiny_models["llama"]), RunnerConfig(kv_cache_bytes=1 << 20, block_size=4, threads=1)
    )


def test_greedy_batch_with_chunked_prefill_matches_transformers(tiny_models, llama_runner):
    rng = np.random.default_rng(0)
    requests = [Request(i, rng.integers(3, 128, n).tolist(), 6) for i, n in enumerate((17, 4, 11))]
    generate(llama_runner, requests, chunk_tokens=6)
    for r in requests:
        assert r.outputs == hf_greedy(tiny_models["llama"], r.prompt, 6)


def test_logprobs_and_prompt_logprobs_match_reference_across_chunks(tiny_models, llama_runner):
    from tests.gpu.test_model import reference_logits

    prompt = np.random.default_rng(1).integers(3, 128, 15).tolist()
    request = Request(7, prompt, 3, sampling={"num_logprobs": 3}, prompt_logprobs=2)
    other = Request(8, prompt[:5], 3, sampling={"num_logprobs": 1})
    generate(llama_runner, [request, other], chunk_tokens=4)
    raw = torch.log_softmax(reference_logits(tiny_models["llama"], prompt + request.outputs), dim=1)

    positions = [p for res in request.results for p in res["prompt_positions"]]
    assert positions == list(range(1, 15))
    scored = [lp for res in request.results for lp in res["prompt_logprobs"]]
    expected = [raw[p - 1, prompt[p]].item() for p in positions]
    assert np.allclose(scored, expected, atol=1e-4)
    ranks = [rk for res in request.results for rk in res["prompt_ranks"]]
    assert ranks == [int((raw[p - 1] > raw[p - 1, prompt[p]]).sum()) + 1 for p in positions]
    top = [ids for res in request.results for ids in res["prompt_top_ids"]]
    assert top == [raw[p - 1].topk(2).indices.tolist() for p in positions]

    sampled = [res for res in request.results if res["token"] >= 0]
    for i, res in enumerate(sampled):
        row = raw[len(prompt) - 1 + i]
        assert res["rank"] == 1 and abs(res["logprob"] - row.max().item()) < 1e-4
        assert res["top_ids"] == row.topk(3).indices.tolist()
    # When its batch mate asks for 3 top logprobs, the other request's 2 extra columns are padding.
    other_sampled = [res for res in other.results if res["token"] >= 0]
    assert any(len(res["top_ids"]) == 3 for res in other_sampled)
    for res in other_sampled:
        assert res["top_ids"][1:] == [-1] * (len(res["top_ids"]) - 1)
        assert res["prompt_positions"] == []


def test_seeded_requests_ignore_their_batch_mates(tiny_models):
    def run(with_others: bool) -> list[int]:
        runner = ModelRunner.from_path(
            str(tiny_models["qwen2"]),
            RunnerConfig(kv_cache_bytes=1 << 20, block_size=4, seed=int(with_others)),
        )
        seeded = Request(1, [5, 6, 7, 8, 9], 8, sampling={"temperature": 1.0, "seed": 1234})
        others = [
            Request(2, [3, 4], 8, sampling={"temperature": 0.8}),
            Request(3, [10] * 9, 8, sampling={"temperature": 1.2, "seed": 99}),
        ]
        generate(
            runner,
            [seeded, *others] if with_others else [seeded],
            chunk_tokens=3 if with_others else 5,
        )
        return seeded.outputs

    assert run(False) == run(True)


def test_min_tokens_and_stop_ids_through_the_runner(llama_runner):
    probe = Request(1, [5, 6, 7], 1)
    generate(llama_runner, [probe])
    first = probe.outputs[0]
    llama_runner.free([1])
    held = Request(2, [5, 6, 7], 1, sampling={"min_tokens": 1, "stop_token_ids": [first]})
    generate(llama_runner, [held])
    assert held.outputs[0] != first


def test_a_step_says_how_long_its_sampling_took(llama_runner):
    """The stage trace splits execute's forward span into the model and sampling by it."""
    started = time.perf_counter_ns()
    generate(llama_runner, [Request(3, [5, 6, 7], 1)], chunk_tokens=8)  # one step
    assert 0 < llama_runner.last_sample_ns < time.perf_counter_ns() - started


def test_free_forgets_requests(llama_runner):
    requests = [Request(i, [1, 2, 3], 2) for i in (10, 11)]
    generate(llama_runner, requests)
    assert llama_runner.tracked_handles == {10, 11}
    llama_runner.free(np.array([10]))
    assert llama_runner.tracked_handles == {11}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runner_stays_close_to_float32(tiny_models, dtype):
    prompt = np.random.default_rng(3).integers(3, 128, 9).tolist()
    logprobs = {}
    for run_dtype in ("float32", dtype):
        runner = ModelRunner.from_path(
            str(tiny_models["mistral"]),
            RunnerConfig(dtype=run_dtype, kv_cache_bytes=1 << 20, block_size=4),
        )
        # weights, activations and the KV cache in that dtype (--dtype half runs float16)
        assert runner.kv_cache.layers[0][0].dtype == getattr(torch, run_dtype)
        assert runner.model.model.embed_tokens.weight.dtype == getattr(torch, run_dtype)
        request = Request(1, prompt, 1, prompt_logprobs=0)
        generate(runner, [request])
        logprobs[run_dtype] = np.array(request.results[0]["prompt_logprobs"])
    assert np.abs(logprobs["float32"] - logprobs[dtype]).max() < 0.05


def test_unknown_dtype_is_rejected(tiny_models):
    with pytest.raises(ValueError, match="float64"):
        ModelRunner.from_path(str(tiny_models["llama"]), RunnerConfig(dtype="float64"))


def _prompt_logprobs(path: str, config: RunnerConfig, prompt: list[int]) -> np.ndarray:
    runner = ModelRunner.from_path(path, config)
    request = Request(1, prompt, 1, prompt_logprobs=0)
    generate(runner, [request])
    return np.array(request.results[0]["prompt_logprobs"])


def test_int4_on_q4_1_gguf_matches_the_dequantized_model(tiny_models, tmp_path):
    from tests.gpu.test_loader import Q, write_gguf

    linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {f"blk.{i}.{name}.weight": Q.Q4_1 for i in range(2) for name in linears}
    path = write_gguf(tiny_models["llama"], tmp_path / "q4_1.gguf", "llama", types)
    prompt = np.random.default_rng(4).integers(3, 128, 12).tolist()
    base = RunnerConfig(kv_cache_bytes=1 << 20, block_size=4)
    dense = _prompt_logprobs(path, base, prompt)
    # Lossless in float32 compute on torch's kernels; the fast default rounds the activations
    # (to int8 per 32 on the native kernels, to bfloat16 on torch's).
    exact = replace(
        base,
        quantization="int4",
        quantized_compute_dtype="float32",
        quantized_max_rows=None,
        native_kernels=False,
        kv_cache_dtype="float32",
    )
    assert np.abs(dense - _prompt_logprobs(path, exact, prompt)).max() < 1e-4
    fast = _prompt_logprobs(path, replace(base, quantization="int4"), prompt)
    assert np.abs(dense - fast).max() < 0.1


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_runner_stays_close(tiny_models, mode):
    prompt = np.random.default_rng(5).integers(3, 128, 10).tolist()
    base = RunnerConfig(kv_cache_bytes=1 << 20, block_size=4)
    dense = _prompt_logprobs(str(tiny_models["qwen2"]), base, prompt)
    quantized = _prompt_logprobs(
        str(tiny_models["qwen2"]), replace(base, quantization=mode), prompt
    )
    assert 0 < np.abs(dense - quantized).max() < 0.1


@pytest.mark.parametrize("native_kernels", [True, False])
def test_bfloat16_kv_cache(tiny_models, native_kernels):
    """A 16-bit cache holds twice the blocks and changes the logprobs only slightly."""
    prompt = np.random.default_rng(6).integers(3, 128, 10).tolist()
    path = str(tiny_models["llama"])
    base = RunnerConfig(kv_cache_bytes=1 << 20, block_size=4, native_kernels=native_kernels)
    half = replace(base, kv_cache_dtype="bfloat16")
    assert ModelRunner.from_path(path, half).num_kv_blocks == 2 * (
        ModelRunner.from_path(path, base).num_kv_blocks
    )
    dense = _prompt_logprobs(path, base, prompt)
    assert 0 < np.abs(dense - _prompt_logprobs(path, half, prompt)).max() < 0.05
    # "auto" picks it for quantized weights.
    quantized = ModelRunner.from_path(path, replace(base, quantization="int8"))
    assert quantized.kv_cache.layers[0][0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float8"):
        ModelRunner.from_path(path, replace(base, kv_cache_dtype="float8"))


def test_unknown_quantization_is_rejected(tiny_models):
    with pytest.raises(ValueError, match="int3"):
        ModelRunner.from_path(str(tiny_models["llama"]), RunnerConfig(quantization="int3"))


def test_copied_blocks_hold_the_same_keys_and_values_in_every_layer(llama_runner):
    cache = llama_runner.kv_cache
    for k_cache, v_cache in cache.layers:
        k_cache[3].normal_()
        v_cache[3].normal_()
    llama_runner.copy_blocks(np.array([[3, 5], [3, 6]], np.int32))
    for k_cache, v_cache in cache.layers:
        for destination in (5, 6):
            assert torch.equal(k_cache[destination], k_cache[3])
            assert torch.equal(v_cache[destination], v_cache[3])


def test_an_fp8_kv_cache_is_refused_off_the_triton_kernels(tiny_models) -> None:
    config = RunnerConfig(kv_cache_bytes=1 << 20, block_size=4, threads=1, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="needs the Triton"):
        ModelRunner.from_path(str(tiny_models["llama"]), config)


def test_plain_greedy_steps_take_the_argmax_path_and_match_the_sampler(
    tiny_models, monkeypatch
) -> None:
    """A batch of plain greedy rows skips the sampler (an argmax, nothing per row); its steps,
    prefill chunks beside decodes included, give what the sampler gives, entry for entry."""
    import gpu.runner

    def run(fast: bool) -> list[list[dict]]:
        if not fast:
            monkeypatch.setattr(gpu.runner, "_plain_greedy", lambda batch: False)
        runner = ModelRunner.from_path(
            str(tiny_models["llama"]), RunnerConfig(kv_cache_bytes=1 << 20, block_size=4, threads=1)
        )
        rng = np.random.default_rng(3)
        requests = [
            Request(i, rng.integers(3, 128, n).tolist(), 5) for i, n in enumerate((9, 3, 14))
        ]
        generate(runner, requests, chunk_tokens=4)
        monkeypatch.undo()
        return [r.results for r in requests]

    fast, full = run(True), run(False)
    assert _same(fast, full)


def _same(a: object, b: object) -> bool:
    """Equal, nan equal to nan (the logprob of an entry that did not ask for one)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize(
    "knob",
    [
        dict(temperature=0.7),
        dict(num_logprobs=0),
        dict(min_tokens=3),
        dict(repetition_penalty=1.2),
        dict(logit_bias_ids=[5]),
        dict(allowed_token_ids=[5, 6]),
        dict(forced_token_ids=7),
    ],
)
def test_any_knob_keeps_a_batch_on_the_sampler(knob) -> None:
    from gpu.runner import _plain_greedy

    def batch(**sampling: object) -> StepBatch:
        request = Request(0, [1, 2], 1, sampling=sampling)
        return StepBatch(
            handles=np.zeros(1, np.int64),
            input_ids=np.zeros(1, np.int64),
            positions=np.zeros(1, np.int64),
            query_start_loc=np.array([0, 1], np.int32),
            context_lens=np.ones(1, np.int32),
            block_tables=np.zeros((1, 1), np.int32),
            slot_mapping=np.zeros(1, np.int64),
            prompt_lens=np.ones(1, np.int32),
            sample=np.ones(1, bool),
            sampling=sampling_rows([request]),
            prompt_logprobs=np.full(1, -1, np.int32),
        )

    assert _plain_greedy(batch())
    assert not _plain_greedy(batch(**knob))
