"""What the GPU path decides on the host, tested on CPU: the KV budget from device-memory figures,
the CUDA graph sizes and the padding of a decode step to them, the kernel set per device, the
profiled step, random weights; and (marked cuda) the same on a device."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu import kernels as triton_ops
from gpu.attention import AttentionInputs
from gpu.backends import TORCH_KERNELS, kernels_for
from gpu.cuda_graphs import DecodeGraphs, DecodeRows, capture_sizes, padded_size
from gpu.memory import DeviceMemory, kv_cache_budget
from gpu.runner import ModelRunner, RunnerConfig, StepBatch, profile_batch
from gpu.sampler import SamplingArrays
from stages.text.checkpoint import config_from_hf
from stages.text.random_model import PRESETS, parameter_count, write_random_checkpoint
from tests.gpu.paged import BlockPool, PagedSequence, build_step

GIB = 1 << 30
TINY_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


@pytest.fixture(scope="module")
def tiny_random(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("random")
    (root / "tiny").mkdir()
    (root / "tiny" / "config.json").write_text(json.dumps(TINY_SHAPE))
    return write_random_checkpoint(str(root / "tiny" / "config.json"), str(root))[1]


def random_runner(path: str, **config) -> ModelRunner:
    defaults = {"random_weights": True, "kv_cache_bytes": 1 << 20, "native_kernels": False}
    return ModelRunner.from_path(path, RunnerConfig(**(defaults | config)))


def runner_step(
    pool: BlockPool, chunks: list[tuple[PagedSequence, int]], handles: list[int]
) -> StepBatch:
    """The chunks as one runner step in which every row samples greedily."""
    step = build_step(pool, chunks)
    rows = len(chunks)
    return StepBatch(
        handles=np.array(handles, np.int64),
        input_ids=step.input_ids,
        positions=step.positions,
        query_start_loc=step.query_start_loc,
        context_lens=step.context_lens,
        block_tables=step.block_tables,
        slot_mapping=step.slot_mapping,
        prompt_lens=step.context_lens,
        sample=np.ones(rows, bool),
        sampling=SamplingArrays.defaults(rows),
        prompt_logprobs=np.full(rows, -1, np.int32),
    )


def test_the_kv_cache_takes_what_remains_of_the_fraction():
    h100 = DeviceMemory(
        total_bytes=80 * GIB,
        free_at_start_bytes=79 * GIB,
        weights_bytes=16 * GIB,
        peak_step_bytes=2 * GIB,
        non_torch_bytes=1 * GIB,
    )
    assert kv_cache_budget(h100, 0.9) == 72 * GIB - 19 * GIB
    assert kv_cache_budget(h100, 0.5) == 40 * GIB - 19 * GIB
    with pytest.raises(ValueError, match=r"79\.00 GiB of the device's 80\.00 were free"):
        kv_cache_budget(h100, 1.0)  # the CUDA context holds a gigabyte


def test_another_process_leaving_less_than_the_fraction_free_is_an_error():
    shared = DeviceMemory(
        total_bytes=80 * GIB,
        free_at_start_bytes=50 * GIB,  # another server holds 30 GiB
        weights_bytes=16 * GIB,
        peak_step_bytes=GIB,
        non_torch_bytes=0,
    )
    with pytest.raises(ValueError, match="lower it, or free the device"):
        kv_cache_budget(shared, 0.9)
    assert kv_cache_budget(shared, 0.5) == 40 * GIB - 17 * GIB


def test_a_fraction_the_weights_fill_is_an_error_that_says_what_took_it():
    small = DeviceMemory(
        total_bytes=24 * GIB,
        free_at_start_bytes=24 * GIB,
        weights_bytes=16 * GIB,
        peak_step_bytes=GIB,
        non_torch_bytes=0,
    )
    with pytest.raises(ValueError, match=r"the weights take 16\.00.*--gpu-memory-utilization"):
        kv_cache_budget(small, 0.7)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kv_cache_budget(small, 0.0)


def test_graph_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = capture_sizes(20)
    assert [padded_size(b, sizes) for b in (1, 2, 3, 5, 8, 9, 17, 20)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        20,
        20,
    ]
    assert padded_size(21, sizes) is None


def test_padding_rows_write_no_kv_and_leave_the_real_rows_logits(tiny_random):
    runner = random_runner(tiny_random, dtype="float32")
    model, block_size = runner.model, runner.kv_cache.block_size
    pool = BlockPool(runner.num_kv_blocks, block_size, seed=1)
    rng = np.random.default_rng(0)
    seqs = [PagedSequence(rng.integers(0, 320, n).tolist()) for n in (5, 17, 9)]
    runner.step(runner_step(pool, [(s, len(s.token_ids)) for s in seqs], [0, 1, 2]))
    for s in seqs:
        s.token_ids.append(int(rng.integers(0, 320)))
    step = build_step(pool, [(s, 1) for s in seqs])
    rows = DecodeRows(
        input_ids=step.input_ids,
        positions=step.positions,
        slot_mapping=step.slot_mapping,
        context_lens=step.context_lens,
        block_tables=step.block_tables,
    )
    before = [(k.clone(), v.clone()) for k, v in runner.kv_cache.layers]

    def forward(rows: DecodeRows) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for (k, v), (k0, v0) in zip(runner.kv_cache.layers, before, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        n = len(rows.input_ids)
        inputs = AttentionInputs(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            context_lens=torch.from_numpy(rows.context_lens),
            block_tables=torch.from_numpy(rows.block_tables),
            slot_mapping=torch.from_numpy(rows.slot_mapping),
        )
        with torch.inference_mode():
            logits = model(
                torch.from_numpy(rows.input_ids),
                torch.from_numpy(rows.positions),
                runner.kv_cache.layers,
                inputs,
                torch.arange(n),
            )
        return logits, [t.clone() for layer in runner.kv_cache.layers for t in layer]

    padded = rows.padded(8, rows.block_tables.shape[1] + 3)
    assert padded.slot_mapping[3:].tolist() == [-1] * 5
    assert padded.context_lens[3:].tolist() == [1] * 5
    plain_logits, plain_kv = forward(rows)
    padded_logits, padded_kv = forward(padded)
    torch.testing.assert_close(padded_logits[:3], plain_logits, rtol=1e-5, atol=1e-5)
    written = set((step.slot_mapping // block_size).tolist())  # the real rows' blocks
    olds = [t for layer in before for t in layer]
    for plain, pad, old in zip(plain_kv, padded_kv, olds, strict=True):
        # A batch of 8 rounds a row's K and V differently from one of 3, in the last bits.
        torch.testing.assert_close(pad, plain, rtol=1e-5, atol=1e-5)
        changed = (pad != old).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= written
    with pytest.raises(ValueError, match="does not fit"):
        rows.padded(2, rows.block_tables.shape[1])


class ReplayEagerly:
    """Stands in for a captured CUDA graph on CPU: a replay runs the forward the graph holds, on
    the same static buffers, into the same output tensor."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.logits[: self.size].copy_(self.graphs._forward(self.size))


def graphed_runner(path: str) -> tuple[ModelRunner, DecodeGraphs]:
    """A CPU runner whose decode graphs (sizes 1, 2, 4, 8) replay eagerly on their buffers."""
    runner = random_runner(path, dtype="float32", max_num_seqs=8)
    graphs = DecodeGraphs(
        runner.model, runner.kv_cache.layers, capture_sizes(8), 16, torch.device("cpu")
    )
    for size in graphs.sizes:
        graphs.graphs[size] = ReplayEagerly(graphs, size)  # type: ignore[assignment]
    runner.graphs = graphs
    return runner, graphs


def test_decode_steps_through_the_graph_buffers_sample_what_eager_steps_do(tiny_random):
    graphed, graphs = graphed_runner(tiny_random)
    eager = random_runner(tiny_random, dtype="float32", max_num_seqs=8)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 320, n).tolist() for n in (7, 20, 3)]
    emitted = []
    for runner in (graphed, eager):
        pool = BlockPool(runner.num_kv_blocks, runner.kv_cache.block_size, seed=3)
        seqs = [PagedSequence(list(p)) for p in prompts]
        tokens = runner.step(runner_step(pool, [(s, len(s.token_ids)) for s in seqs], [0, 1, 2]))
        out = [tokens.token_ids.tolist()]
        for _ in range(5):  # three rows padded to a graph of four
            for s, t in zip(seqs, out[-1], strict=True):
                s.token_ids.append(t)
            step = runner_step(pool, [(s, 1) for s in seqs], [0, 1, 2])
            out.append(runner.step(step).token_ids.tolist())
        emitted.append(out)
    assert emitted[0] == emitted[1]
    assert graphs.input_ids[:3].tolist() == emitted[0][-2]  # the last step went through them


def test_verifications_of_drafts_replay_the_graphs_and_emit_what_eager_steps_do(tiny_random):
    """A row verifying drafts is split into sampled one-token rows, which the decode graphs take:
    right, wrong and partly right drafts give, through the graph buffers, the eager tokens."""
    graphed, graphs = graphed_runner(tiny_random)
    eager = random_runner(tiny_random, dtype="float32", max_num_seqs=8)
    prompt = [5, 9, 5, 9, 2, 5, 9, 3]
    pool = BlockPool(eager.num_kv_blocks, eager.kv_cache.block_size, seed=3)
    seq = PagedSequence(list(prompt))
    plain = [int(eager.step(runner_step(pool, [(seq, len(prompt))], [9])).token_ids[0])]
    for _ in range(4):  # plain greedy decoding: the right drafts
        seq.token_ids.append(plain[-1])
        plain.append(int(eager.step(runner_step(pool, [(seq, 1)], [9])).token_ids[0]))
    eager.free([9])
    emitted, accepted = [], []
    for runner in (graphed, eager):
        pool = BlockPool(runner.num_kv_blocks, runner.kv_cache.block_size, seed=3)
        seq = PagedSequence(list(prompt))
        out = [int(runner.step(runner_step(pool, [(seq, len(prompt))], [0])).token_ids[0])]
        taken = []
        for guess in ("right", "wrong", "half"):
            if guess == "right":
                drafts = plain[1:4]
            else:
                drafts = [(out[-1] + 1) % 320, 4, 4] if guess == "wrong" else [out[-1], 4]
            seq.token_ids = prompt + out + drafts
            seq.num_cached = len(prompt) + len(out) - 1
            step = runner_step(pool, [(seq, 1 + len(drafts))], [0])
            step = dataclasses.replace(step, num_draft=np.array([len(drafts)], np.int32))
            result = runner.step(step)
            n = int(result.num_tokens[0])
            out += result.token_ids[:n].tolist()
            taken.append(n - 1)
            if runner is graphed:  # the step went through the graph of its rows' size
                assert graphs.input_ids[: 1 + len(drafts)].tolist() == step.input_ids.tolist()
        emitted.append(out)
        accepted.append(taken)
    assert emitted[0] == emitted[1] and accepted[0] == accepted[1]
    assert emitted[0][:5] == plain and accepted[0][:2] == [3, 0]  # right drafts pass, wrong fail


def test_cuda_takes_the_triton_kernels_and_cpu_does_not():
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        chosen = kernels_for(device)
        assert chosen.rms_norm is triton_ops.rms_norm
        assert chosen.add_rms_norm is triton_ops.fused_add_rms_norm
        assert chosen.silu_mul is triton_ops.silu_mul
    cpu = kernels_for("cpu")
    assert cpu.rms_norm is not triton_ops.rms_norm
    assert kernels_for("cpu", use_native=False) is TORCH_KERNELS


def test_the_profiled_step_is_the_largest_the_scheduler_plans_and_runs(tiny_random):
    batch = profile_batch(num_tokens=100, num_seqs=8, block_size=16)
    lens = np.diff(batch.query_start_loc)
    assert len(batch.input_ids) == 100 and lens.tolist() == [13, 13, 13, 13, 12, 12, 12, 12]
    assert len(set(batch.slot_mapping.tolist())) == 100  # no two tokens share a KV slot
    runner = random_runner(tiny_random)
    out = runner.step(batch)
    assert (out.token_ids >= 0).all() and len(out.token_ids) == 8
    assert len(profile_batch(5, 8, 16).handles) == 5  # fewer tokens than rows


def test_presets_have_the_real_shapes_and_parameter_counts():
    llama8b = config_from_hf(PRESETS["llama-3-8b"])
    assert (llama8b.num_layers, llama8b.hidden_size, llama8b.num_heads) == (32, 4096, 32)
    assert (llama8b.num_kv_heads, llama8b.intermediate_size, llama8b.vocab_size) == (
        8,
        14336,
        128256,
    )
    counts = {name: parameter_count(config_from_hf(raw)) for name, raw in PRESETS.items()}
    # As the checkpoints' model cards and safetensors indexes count them.
    assert counts == {
        "llama-3-8b": 8_030_261_248,
        "llama-3-1b": 1_235_814_400,
        "qwen2.5-0.5b": 494_032_768,
    }


def test_random_weights_are_made_in_the_dtype_and_seeded(tiny_random):
    runner = random_runner(tiny_random, dtype="bfloat16", seed=3)
    params = dict(runner.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert sum(p.numel() for p in params.values()) == parameter_count(runner.model_config)
    assert torch.equal(params["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"].float()
    assert 0.015 < qkv.std().item() < 0.025
    again = random_runner(tiny_random, dtype="bfloat16", seed=3).model.state_dict()
    other = random_runner(tiny_random, dtype="bfloat16", seed=4).model.state_dict()
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(again[name], params[name]) and not torch.equal(other[name], params[name])
    out = runner.step(profile_batch(40, 4, 16))
    assert (out.token_ids >= 0).all()


def test_a_tied_random_model_shares_its_embedding_with_the_lm_head(tmp_path):
    (tmp_path / "tied").mkdir()
    (tmp_path / "tied" / "config.json").write_text(
        json.dumps({**TINY_SHAPE, "tie_word_embeddings": True})
    )
    path = write_random_checkpoint(str(tmp_path / "tied" / "config.json"), str(tmp_path))[1]
    model = random_runner(path, dtype="bfloat16").model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    total = sum(p.numel() for p in model.parameters())
    assert total == parameter_count(model.config)


def test_the_random_model_tokenizer_round_trips_any_text_and_byte(tiny_random):
    from stages.text.chat import render_chat
    from stages.text.tokenizer import load_tokenizer

    bundle = load_tokenizer(tiny_random)
    assert bundle.vocab_size == 320  # every id the model samples decodes
    for text in ("héllo wörld 🙂 日本語", "\x00\x01 tabs\tand\nnewlines", "<|im_start|>user"):
        assert bundle.decode(bundle.encode(text)) == text
    data = bytes(range(256))
    assert b"".join(bundle.token_bytes[i] for i in data) == data
    assert bundle.eos_token_ids == (bundle.tokenizer.token_to_id("<|im_end|>"),)
    assert all(len(bundle.token_bytes[i]) >= 2 for i in range(259, 320))
    prompt = render_chat(bundle.chat_template, [{"role": "user", "content": "hi 🙂"}])
    assert prompt == "<|im_start|>user\nhi 🙂<|im_end|>\n<|im_start|>assistant\n"
    assert bundle.encode(prompt)[0] == bundle.tokenizer.token_to_id("<|im_start|>")


def test_the_same_shape_reuses_its_directory(tmp_path):
    config = tmp_path / "shape" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_SHAPE))
    name, first = write_random_checkpoint(str(config), str(tmp_path))
    assert name == "shape"
    assert write_random_checkpoint(str(config), str(tmp_path))[1] == first
    assert sorted(p.name for p in Path(first).iterdir()) == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    with pytest.raises(ValueError, match="neither a preset"):
        write_random_checkpoint("llama-9-zillion", str(tmp_path))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_decode_steps_equal_eager_ones(tiny_random):
    graphed = random_runner(tiny_random, device="cuda", dtype="bfloat16", max_num_seqs=16)
    eager = random_runner(
        tiny_random, device="cuda", dtype="bfloat16", max_num_seqs=16, enforce_eager=True
    )
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.graphs.sizes == (1, 2, 4, 8, 16)
    eager.model.load_state_dict(graphed.model.state_dict())
    rng = np.random.default_rng(0)
    for batch in (1, 3, 16):
        tokens = []
        for runner in (graphed, eager):
            pool = BlockPool(runner.num_kv_blocks, runner.kv_cache.block_size, seed=batch)
            seqs = [PagedSequence(rng.integers(0, 320, 9).tolist()) for _ in range(batch)]
            ids = list(range(batch))
            runner.step(runner_step(pool, [(s, 9) for s in seqs], ids))
            emitted = []
            for _ in range(4):  # decode steps: graph replays on the first runner
                for s in seqs:
                    s.token_ids.append(int(rng.integers(0, 320)))
                step = runner_step(pool, [(s, 1) for s in seqs], ids)
                emitted.append(runner.step(step).token_ids)
            runner.free(np.arange(batch))
            tokens.append(np.stack(emitted))
            rng = np.random.default_rng(batch)
        np.testing.assert_array_equal(tokens[0], tokens[1])


@pytest.mark.cuda
@needs_cuda
def test_a_cuda_runner_reads_rotary_angles_from_one_table(tiny_random):
    """#33 item 8: the Triton rotary reads the model's table of every position, whose rows are
    the angles a step would compute for itself (the interpreter test runs the forward)."""
    from gpu.backends import rope_angles

    runner = random_runner(
        tiny_random, device="cuda", dtype="bfloat16", max_num_seqs=4, enforce_eager=True
    )
    table = runner.model.angle_table
    max_len = runner.config.max_model_len or runner.model_config.max_position_embeddings
    assert table is not None and table.shape[0] == max_len
    positions = torch.tensor([0, 5, max_len - 1], device="cuda")
    assert torch.equal(
        table[positions], torch.cat(rope_angles(positions, runner.model.inv_freq), 1)
    )


@pytest.mark.cuda
@needs_cuda
def test_gpu_memory_utilization_sizes_the_kv_cache_from_the_device(tiny_random):
    free, total = torch.cuda.mem_get_info()
    fraction = 0.05  # of an H200, 7 GiB: the tiny model leaves nearly all of it to the cache
    assert free > fraction * total
    before = total - free
    runner = random_runner(
        tiny_random, device="cuda", gpu_memory_utilization=fraction, enforce_eager=True
    )
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_cache.layers)
    grown = (total - torch.cuda.mem_get_info()[0]) - before
    assert 0.8 * fraction * total < kv_bytes < fraction * total
    assert grown <= fraction * total * 1.05


@pytest.mark.cuda
@needs_cuda
def test_a_draft_models_weights_and_kv_blocks_come_out_of_the_same_fraction(tiny_random):
    """With a draft model the sizing counts its weights and gives its cache as many blocks as
    the target's, both inside the fraction."""
    free, total = torch.cuda.mem_get_info()
    fraction = 0.05
    before = total - free
    runner = random_runner(
        tiny_random,
        device="cuda",
        gpu_memory_utilization=fraction,
        enforce_eager=True,
        draft_model=tiny_random,
    )
    assert runner.drafter is not None
    draft_layers = runner.drafter.kv_cache.layers
    assert draft_layers[0][0].shape[0] == runner.num_kv_blocks
    kv_bytes = sum(
        k.numel() * k.element_size() * 2 for k, _ in [*runner.kv_cache.layers, *draft_layers]
    )
    grown = (total - torch.cuda.mem_get_info()[0]) - before
    assert 0.8 * fraction * total < kv_bytes < fraction * total
    assert grown <= fraction * total * 1.05


def test_a_draft_model_loaded_with_the_target_drafts_on_a_cache_as_large(tiny_random):
    """from_model's `draft` (the sized path's, loaded before the measurement) gets a KV cache of
    the target's block count and drafts as an attached one does: an equal draft is always
    accepted."""
    target = random_runner(tiny_random)
    draft = random_runner(tiny_random).model
    runner = ModelRunner.from_model(target.model, target.config, draft=draft)
    assert runner.drafter is not None
    assert runner.drafter.kv_cache.layers[0][0].shape[0] == runner.num_kv_blocks
    pool = BlockPool(runner.num_kv_blocks, runner.kv_cache.block_size)
    seq = PagedSequence([5, 9, 5, 9, 2, 5, 9, 3])
    out = runner.step(runner_step(pool, [(seq, 8)], [0]))
    seq.token_ids.append(int(out.token_ids[0]))
    seq.num_cached = 8
    seq.token_ids += [-1, -1, -1]  # three placeholders the drafter fills in
    step = runner_step(pool, [(seq, 4)], [0])
    step = dataclasses.replace(step, num_draft=np.array([3], np.int32))
    out = runner.step(step)
    assert int(out.num_tokens[0]) == 4  # every draft accepted, and a bonus token


def write_quantized_gguf(runner: ModelRunner, path: Path) -> str:
    """The runner's model as a llama GGUF: Q8_0 linears, an F16 embedding, F32 norms (its rows
    permuted as llama.cpp writes them: the loader puts them back). No transformers needed."""
    import gguf
    from gguf.quants import quantize

    from gpu.loader import _GGUF_GLOBAL_NAMES, _GGUF_LAYER_NAMES

    c = runner.model_config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_vocab_size(c.vocab_size)
    names = {hf: name for name, hf in _GGUF_GLOBAL_NAMES.items()}
    state = runner.model.state_dict()
    q, kv = c.q_size, c.kv_size
    hf_tensors = {k: v for k, v in state.items() if "qkv_proj" not in k and "gate_up" not in k}
    for layer in range(c.num_layers):
        prefix = f"model.layers.{layer}"
        qkv = state[f"{prefix}.self_attn.qkv_proj.weight"]
        gate_up = state[f"{prefix}.mlp.gate_up_proj.weight"]
        hf_tensors |= {
            f"{prefix}.self_attn.q_proj.weight": qkv[:q],
            f"{prefix}.self_attn.k_proj.weight": qkv[q : q + kv],
            f"{prefix}.self_attn.v_proj.weight": qkv[q + kv :],
            f"{prefix}.mlp.gate_proj.weight": gate_up[: c.intermediate_size],
            f"{prefix}.mlp.up_proj.weight": gate_up[c.intermediate_size :],
        }
        for name, hf in _GGUF_LAYER_NAMES.items():
            names[f"{prefix}.{hf}"] = f"blk.{layer}.{name}"
    for hf, tensor in hf_tensors.items():
        values = tensor.float().numpy()
        name = names[hf]
        heads = c.num_heads if ".attn_q." in name else c.num_kv_heads
        if ".attn_q." in name or ".attn_k." in name:  # llama.cpp's converter permutes them
            values = values.reshape(heads, 2, -1, values.shape[1]).swapaxes(1, 2)
            values = values.reshape(-1, c.hidden_size)
        if name.endswith("norm.weight"):
            writer.add_tensor(name, np.ascontiguousarray(values))
        elif name == "token_embd.weight":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(np.ascontiguousarray(values), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def quantized_gguf(tiny_random, tmp_path_factory) -> str:
    source = random_runner(tiny_random, dtype="float32", seed=5)
    return write_quantized_gguf(source, tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf")


def test_a_q8_0_gguf_loads_dequantized_into_bfloat16(tiny_random, quantized_gguf):
    runner = ModelRunner.from_path(
        quantized_gguf, RunnerConfig(dtype="bfloat16", kv_cache_bytes=1 << 20)
    )
    source = dict(random_runner(tiny_random, dtype="float32", seed=5).model.named_parameters())
    for name, param in runner.model.named_parameters():
        assert param.dtype == torch.bfloat16
        # Q8_0 moves a weight by at most 1/254 of its block's range, bf16 by 1/256 of it.
        torch.testing.assert_close(param.float(), source[name], rtol=0.01, atol=2e-3)


@pytest.mark.cuda
@needs_cuda
def test_gguf_weights_are_dequantized_to_bfloat16_on_cuda(quantized_gguf):
    cuda = ModelRunner.from_path(
        quantized_gguf, RunnerConfig(device="cuda", dtype="bfloat16", max_num_seqs=4)
    )
    cpu = ModelRunner.from_path(
        quantized_gguf, RunnerConfig(dtype="float32", kv_cache_bytes=1 << 20, native_kernels=False)
    )
    cpu_params = dict(cpu.model.named_parameters())
    for name, param in cuda.model.named_parameters():
        assert param.dtype == torch.bfloat16 and param.device.type == "cuda"
        assert torch.equal(param.cpu(), cpu_params[name].to(torch.bfloat16)), name
    pool = BlockPool(cuda.num_kv_blocks, cuda.kv_cache.block_size)
    seq = PagedSequence([5, 17, 200, 3, 99, 42, 7, 311])
    assert 0 <= cuda.step(runner_step(pool, [(seq, 8)], [0])).token_ids[0] < 320


@pytest.mark.cuda
@needs_cuda
def test_the_sampler_on_cuda_takes_the_tokens_it_takes_on_the_host():
    from gpu.sampler import TokenHistory, sample

    rows, vocab = 8, 300
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3

    def padded(lists: list[list[int]]) -> np.ndarray:
        width = max(len(r) for r in lists)
        return np.array([r + [-1] * (width - len(r)) for r in lists], np.int32)

    bitmask = np.full((rows, (vocab + 31) // 32), -1, np.int32)
    bitmask[5, :4] = 0  # row 5's grammar bans tokens 0-127
    params = SamplingArrays.defaults(
        rows,
        num_logprobs=np.array([5, 0, -1, 2, 1, 3, 0, 2], np.int32),
        repetition_penalty=np.array([1.3, 1, 1, 1, 1, 1, 1, 1], np.float32),
        frequency_penalty=np.array([0, 0.8, 0, 0, 0, 0, 0, 0], np.float32),
        presence_penalty=np.array([0, 0, 1.5, 0, 0, 0, 0, 0], np.float32),
        min_tokens=np.array([0, 0, 0, 5, 0, 0, 0, 0], np.int32),
        stop_token_ids=padded([[], [], [], [int(logits[3].argmax())], [], [], [], []]),
        logit_bias_ids=padded([[], [], [], [], [7], [], [], []]),
        logit_bias_values=np.array([[0], [0], [0], [0], [100.0], [0], [0], [0]], np.float32),
        allowed_token_ids=padded([[], [], [], [], [], [], [11, 12, 13], []]),
        logprob_token_ids=padded([[], [], [], [], [], [], [], [3, 4]]),
        token_bitmask=bitmask,
    )
    history = [TokenHistory.of([1, 2, 3], [int(logits[r].argmax()), 9]) for r in range(rows)]
    host = sample(logits, params, history)
    device = sample(logits.cuda(), params, history, torch.Generator("cuda").manual_seed(0))
    assert device.token_ids.device.type == "cuda"
    assert device.token_ids.cpu().tolist() == host.token_ids.tolist()
    assert device.top_ids.cpu().tolist() == host.top_ids.tolist()
    torch.testing.assert_close(device.logprobs.cpu(), host.logprobs, equal_nan=True)
    torch.testing.assert_close(device.top_logprobs.cpu(), host.top_logprobs)
    # Random rows draw from the filtered distribution with a generator on the device.
    hot = SamplingArrays.defaults(
        rows, temperature=np.full(rows, 1.0, np.float32), top_k=np.full(rows, 3, np.int32),
        seed=np.array([7, -1, 7, -1, 7, -1, 7, -1], np.int64),
    )  # fmt: skip
    drawn = sample(logits.cuda(), hot, history, torch.Generator("cuda").manual_seed(0))
    top3 = logits.topk(3, dim=1).indices
    assert all(int(t) in top3[r].tolist() for r, t in enumerate(drawn.token_ids.cpu()))
