"""Beam search through the whole server (HTTP, four stages) on a tiny random Llama in float32 (and SmolLM2, slow): the
choices equal transformers' `generate(num_beams=W, num_return_sequences=W, ...)`, best first,
and nothing stays held once requests end or are aborted."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.serving import http_get, running_server
from tests.server.live import free_port
from tests.stages.tiny import build_tiny_chat_model

MAX_MODEL_LEN = 256


def metric(port: int, name: str) -> float:
    _, text = http_get(port, "/metrics")
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read().decode()
        return response.status, raw if body.get("stream") else json.loads(raw)
    finally:
        connection.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    port = free_port()
    args = [
        str(model),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "2MiB",
        "--threads",
        "1",
    ]
    with running_server(args, port, tmp_path_factory.mktemp("logs") / "serve.log"):
        yield port


@pytest.fixture(scope="module")
def reference(model):
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def generate(prompt: list[int], stop_ids: list[int], **kwargs: Any) -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                eos_token_id=stop_ids,
                pad_token_id=stop_ids[0],
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                **kwargs,
            )
        hypotheses = []
        for row in out[:, len(prompt) :].tolist():
            ends = [i for i, t in enumerate(row) if t in stop_ids]
            hypotheses.append(row[: ends[0] + 1] if ends else row)
        return hypotheses

    return generate, hf.config.eos_token_id


PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101]


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping", "max_tokens", "prompt_len"),
    [
        (2, 1.0, False, 12, 16),  # the prompt fills its one block: beams start a block each
        (4, 0.5, True, 16, 13),  # the prompt's block is partly filled: copied on write at once
        (3, 2.0, "never", 10, 7),
        (1, 1.0, False, 8, 16),
    ],
)
def test_beams_equal_transformers(
    server, reference, width, length_penalty, early_stopping, max_tokens, prompt_len
):
    generate, eos = reference
    prompt = PROMPT[:prompt_len]
    # A token the model favours also stops beams, so that hypotheses end early and the length
    # penalty and early stopping decide among them.
    greedy = generate(prompt, [eos], max_new_tokens=3)[0]
    stop_ids = [eos, greedy[1]]
    expected = generate(
        prompt,
        stop_ids,
        num_beams=width,
        num_return_sequences=width,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_new_tokens=max_tokens,
    )
    status, body = post(
        server,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "n": width,
            "use_beam_search": True,
            "length_penalty": length_penalty,
            "early_stopping": early_stopping,
            "max_tokens": max_tokens,
            "stop_token_ids": [greedy[1]],
            "include_stop_str_in_output": True,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == expected
    for choice, hypothesis in zip(choices, expected, strict=True):
        ended = hypothesis[-1] in stop_ids
        assert choice["finish_reason"] == ("stop" if ended else "length")
    assert body["usage"]["completion_tokens"] == sum(map(len, expected))


def test_chat_beams_stream_and_honour_stop_strings(server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello world!"}],
        "n": 3,
        "use_beam_search": True,
        "max_tokens": 12,
        "ignore_eos": True,
    }
    status, full = post(server, "/v1/chat/completions", body)
    assert status == 200, full
    texts = [c["message"]["content"] for c in sorted(full["choices"], key=lambda c: c["index"])]
    assert len(texts) == 3 and all(c["finish_reason"] == "length" for c in full["choices"])
    assert len(set(texts)) == 3  # distinct hypotheses
    status, raw = post(server, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    streamed = ["", "", ""]
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert streamed == texts
    # A stop string in the best hypothesis ends beams as it appears: scored by log-probability
    # alone (length_penalty 0), that hypothesis cut at the string is at least as good as before.
    stop = texts[0][len(texts[0]) // 2 :][:2]
    ranked = {**body, "stop": [stop], "length_penalty": 0.0}
    status, stopped = post(server, "/v1/chat/completions", ranked)
    assert status == 200, stopped
    choices = sorted(stopped["choices"], key=lambda c: c["index"])
    assert all(stop not in c["message"]["content"] for c in choices)
    assert choices[0]["finish_reason"] == "stop"
    assert texts[0].startswith(choices[0]["message"]["content"])


def test_nothing_stays_held_after_beam_searches_end_or_are_aborted(server):
    body = {
        "model": "tiny",
        "prompt": PROMPT * 3,
        "n": 4,
        "use_beam_search": True,
        "max_tokens": 60,
        "ignore_eos": True,
    }
    # A client that goes away mid-search: its choices are aborted.
    connection = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    time.sleep(0.5)
    connection.close()
    status, done = post(server, "/v1/completions", {**body, "max_tokens": 20})
    assert status == 200 and len(done["choices"]) == 4
    deadline = time.monotonic() + 10
    while metric(server, "vllm:num_requests_running") or metric(server, "vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "beam search left requests or KV blocks held"
        time.sleep(0.1)


@pytest.mark.slow
def test_smollm2_beams_equal_transformers_in_float32(smollm2_gguf, tmp_path):
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.text.tokenizer import load_tokenizer

    directory, name = os.path.dirname(smollm2_gguf), os.path.basename(smollm2_gguf)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], tokenize=False, add_generation_prompt=True
    )
    prompt = load_tokenizer(smollm2_gguf).encode(text)
    stop_ids = list(load_tokenizer(smollm2_gguf).eos_token_ids)
    width, max_tokens = 4, 24
    with torch.inference_mode():
        out = hf.eval().generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            length_penalty=1.0,
            early_stopping=True,
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=stop_ids,
            pad_token_id=stop_ids[0],
        )
    expected = []
    for row in out[:, len(prompt) :].tolist():
        ends = [i for i, t in enumerate(row) if t in stop_ids]
        expected.append(row[: ends[0] + 1] if ends else row)
    port = free_port()
    args = [smollm2_gguf, "--quantization", "none", "--dtype", "float32", "--threads", "2"]
    with running_server(args, port, tmp_path / "serve.log"):
        status, body = post(
            port,
            "/v1/completions",
            {
                "prompt": prompt,
                "n": width,
                "use_beam_search": True,
                "early_stopping": True,
                "max_tokens": max_tokens,
                "include_stop_str_in_output": True,
                "return_token_ids": True,
            },
        )
    assert status == 200, body
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == expected


def test_more_candidates_than_the_vocabulary_holds_are_not_asked_for(server):
    # (1 + 300 stop ids) * 4 candidates per beam: more than the 384 tokens there are
    status, body = post(
        server,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "n": 4,
            "use_beam_search": True,
            "max_tokens": 4,
            "stop_token_ids": list(range(1, 301)),
            "length_penalty": 1e6,
        },
    )
    assert status == 200, body
    assert len(body["choices"]) == 4
