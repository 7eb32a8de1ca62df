"""LoRA adapters through the real process tree and the official openai client: two adapters and
the base model each write their own greedy tokens (their PEFT-merged models'), together as alone;
/v1/models lists the adapters; adapters load and unload at run time."""

from __future__ import annotations

import concurrent.futures
import http.client
import json

import openai
import pytest

from tests.e2e.serving import http_get, running_server
from tests.lora_adapters import build_peft_adapter
from tests.server.live import free_port
from tests.stages.tiny import build_tiny_chat_model

PROMPT = [5, 17, 42, 99, 7, 63, 120, 11, 250, 31]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_chat_model(root / "base")
    adapters = {
        "alpha": build_peft_adapter(base, root / "alpha", seed=1, rank=8),
        "beta": build_peft_adapter(
            base, root / "beta", seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj")
        ),
        "gamma": build_peft_adapter(base, root / "gamma", seed=3, rank=2, use_rslora=True),
        "too_big": build_peft_adapter(base, root / "too_big", seed=4, rank=16),
    }
    return base, adapters


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    base, adapters = models
    port = free_port()
    args = [
        str(base),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "2MiB",
        "--threads",
        "1",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"alpha={adapters['alpha']}",
        json.dumps({"name": "beta", "path": str(adapters["beta"]), "base_model_name": "tiny"}),
    ]
    log_path = tmp_path_factory.mktemp("logs") / "serve.log"
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with running_server(args, port, log_path, env) as process:
        yield port, process


@pytest.fixture(scope="module")
def client(server):
    port, _ = server
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def greedy(client, model: str) -> list[int]:
    response = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert response.model == model
    return list(response.choices[0].model_extra["token_ids"])


def reference(base, adapter) -> list[int]:
    """Greedy tokens of the PEFT-merged model (or the base alone), step by step."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(model.eval()(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(PROMPT) :]


def post(port: int, path: str, body: dict) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def test_models_lists_each_adapter_with_its_parent(client, models):
    _, adapters = models
    cards = {card.id: card for card in client.models.list().data}
    assert {"tiny", "alpha", "beta"} <= set(cards)
    assert cards["tiny"].model_extra["parent"] is None
    for name in ("alpha", "beta"):
        assert cards[name].model_extra["parent"] == "tiny"
        assert cards[name].model_extra["root"] == str(adapters[name])
    assert client.models.retrieve("alpha").id == "alpha"


def test_each_adapter_writes_its_merged_models_tokens_alone_and_mixed(client, models):
    base, adapters = models
    expected = {
        "tiny": reference(base, None),
        "alpha": reference(base, adapters["alpha"]),
        "beta": reference(base, adapters["beta"]),
    }
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # the adapters matter
    alone = {model: greedy(client, model) for model in expected}
    assert alone == expected
    # Sent at once, they share steps (one per token for all of them).
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        names = [*expected, *expected]
        mixed = list(pool.map(lambda model: greedy(client, model), names))
    assert mixed == [expected[model] for model in names]


def test_unknown_model_is_vllms_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        greedy(client, "nope")
    assert caught.value.body["message"] == "The model `nope` does not exist."


def test_load_use_and_unload_an_adapter_at_run_time(server, client, models):
    port, _ = server
    base, adapters = models
    body = {"lora_name": "gamma", "lora_path": str(adapters["gamma"])}
    assert post(port, "/v1/load_lora_adapter", body) == (
        200,
        "Success: LoRA adapter 'gamma' added successfully.",
    )
    assert "gamma" in {card.id for card in client.models.list().data}
    assert greedy(client, "gamma") == reference(base, adapters["gamma"])
    status, answer = post(port, "/v1/load_lora_adapter", body)
    assert status == 400 and "has already been loaded" in json.loads(answer)["error"]["message"]
    # vLLM's load_inplace: the name now serves another adapter's weights, none of the old ones
    # (nor prefixes cached with them)
    replaced = {"lora_name": "gamma", "lora_path": str(adapters["beta"]), "load_inplace": True}
    assert post(port, "/v1/load_lora_adapter", replaced)[0] == 200
    assert greedy(client, "gamma") == reference(base, adapters["beta"])
    assert post(port, "/v1/unload_lora_adapter", {"lora_name": "gamma"}) == (
        200,
        "Success: LoRA adapter 'gamma' removed successfully.",
    )
    with pytest.raises(openai.NotFoundError):
        greedy(client, "gamma")
    status, answer = post(port, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert status == 404 and "cannot be found" in json.loads(answer)["error"]["message"]


def test_load_refuses_what_cannot_be_served(server, models, tmp_path):
    port, _ = server
    _, adapters = models
    status, answer = post(
        port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}
    )
    message = json.loads(answer)["error"]["message"]
    assert status == 404 and message.startswith("Loading lora x failed: No adapter found for")
    status, answer = post(
        port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["too_big"])}
    )
    error = json.loads(answer)["error"]
    assert status == 400 and "greater than max_lora_rank 8" in error["message"]
    status, answer = post(port, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/x"})
    message = json.loads(answer)["error"]["message"]
    assert (
        status == 400 and message == "The lora adapter 'tiny' conflicts with a served base model."
    )
    assert http_get(port, "/health")[0] == 200


def test_lora_requests_info_names_the_running_adapters(server, client):
    """vLLM's vllm:lora_requests_info (read by LoRA-aware routers): its labels name the
    adapters of the running and the waiting requests, its value says since when."""
    port, _ = server

    def info() -> list[str]:
        lines = http_get(port, "/metrics")[1].splitlines()
        return [line for line in lines if line.startswith("vllm:lora_requests_info{")]

    stream = client.completions.create(
        model="alpha",
        prompt=PROMPT,
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # running now
    (running,) = info()
    stream.close()
    assert 'max_lora="2"' in running and 'running_lora_adapters="alpha"' in running
    assert 'waiting_lora_adapters=""' in running
    assert float(running.split()[-1]) > 1.7e9  # wall-clock seconds, as vLLM's
    greedy(client, "tiny")  # a step after the abort: nothing runs under an adapter
    (idle,) = info()
    assert 'running_lora_adapters=""' in idle
