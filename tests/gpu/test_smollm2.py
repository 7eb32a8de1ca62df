"""The default model, SmolLM2-135M-Instruct Q4_1 GGUF, against transformers reading the same file."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gpu.runner import ModelRunner, RunnerConfig
from stages.text.tokenizer import load_tokenizer
from tests.gpu.test_runner import Request, generate

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
NEW_TOKENS = 16


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.dirname(smollm2_gguf), os.path.basename(smollm2_gguf)
    reference_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    reference = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()
    bundle = load_tokenizer(smollm2_gguf)
    runner = ModelRunner.from_path(smollm2_gguf, RunnerConfig(kv_cache_bytes=32 << 20, threads=2))

    requests = []
    for i, prompt in enumerate(PROMPTS):
        text = reference_tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = bundle.encode(text)
        assert prompt_ids == reference_tokenizer(text, add_special_tokens=False).input_ids
        requests.append(Request(i, prompt_ids, NEW_TOKENS))
    generate(runner, requests, chunk_tokens=24)

    for request in requests:
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([request.prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(request.prompt) :].tolist()
        assert request.outputs[: len(expected)] == expected, bundle.decode(request.outputs)


@pytest.mark.slow
def test_smollm2_greedy_with_prompt_lookup_is_plain_greedy(smollm2_gguf):
    """Speculative decoding on the default model as it is served (int4, bf16 KV cache): the
    verified runs emit plain greedy decoding's tokens, and prompt lookup finds drafts to accept."""
    from stages.speculation import propose_ngram
    from stages.text.chat_template import render_chat
    from tests.gpu.test_speculative import speculate

    bundle = load_tokenizer(smollm2_gguf)
    runner = ModelRunner.from_path(
        smollm2_gguf, RunnerConfig(kv_cache_bytes=32 << 20, threads=2, quantization="int4")
    )
    prompts = [
        "Copy this sentence exactly: the quick brown fox jumps over the lazy dog near the river.",
        "Repeat after me: one two three four five six seven eight nine ten.",
        "What is the capital of France?",
    ]
    accepted = 0
    for i, prompt in enumerate(prompts):
        assert bundle.chat_template is not None
        text = render_chat(bundle.chat_template, [{"role": "user", "content": prompt}])
        prompt_ids = bundle.encode(text)
        plain = Request(10 + i, prompt_ids, 40)
        generate(runner, [plain], chunk_tokens=64)
        runner.free([10 + i])
        fast = Request(20 + i, prompt_ids, 40)
        steps = speculate(
            runner,
            fast,
            lambda out, ids=prompt_ids: propose_ngram(
                np.array(ids + out, np.int32), 2, 5, 5
            ).tolist(),
        )
        runner.free([20 + i])
        assert fast.outputs == plain.outputs, bundle.decode(fast.outputs)
        accepted += sum(a for _, a in steps)
    assert accepted > 0
