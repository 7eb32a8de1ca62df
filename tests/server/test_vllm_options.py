"""Server options a `vllm serve` user passes, each taking effect on a real Hypercorn server,
driven by the official `openai` client (raw HTTP where the client cannot say it)."""

from __future__ import annotations

import contextlib
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import structlog
from openai.types.chat import ChatCompletionMessageParam

from server.app import create_app
from server.config import ServerConfig
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer, free_port
from tests.server.test_openai_client import raw_request

API_KEY = "sk-test"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "one two three"}]


@contextlib.contextmanager
def serving(engine: FakeEngine, **options: Any) -> Iterator[tuple[LiveServer, openai.OpenAI]]:
    """The app with these ServerConfig options on a live server, and a client of it."""
    config = ServerConfig(host="127.0.0.1", port=free_port(), api_key=API_KEY, **options)
    with (
        LiveServer(create_app(engine, config), config) as live,
        openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0) as client,
    ):
        yield live, client


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


def test_several_served_model_names(engine: FakeEngine) -> None:
    with serving(engine, served_model_name="first", served_model_aliases=("second",)) as (_, c):
        assert [m.id for m in c.models.list().data] == ["first", "second"]
        assert c.models.retrieve("second").id == "second"
        # any name is accepted; responses report the first, as vLLM's do
        assert c.chat.completions.create(model="second", messages=MESSAGES).model == "first"
        assert c.completions.create(model="first", prompt="a b").model == "first"
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="third", messages=MESSAGES)


def test_response_role(engine: FakeEngine) -> None:
    with serving(engine, response_role="model") as (_, client):
        reply = client.chat.completions.create(model="fake-model", messages=MESSAGES)
        assert reply.choices[0].message.role == "model"
        chunks = list(
            client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        )
        assert chunks[0].choices[0].delta.role == "model"
        # without a generation prompt the reply continues the last message, in its role
        continued = client.chat.completions.create(
            model="fake-model",
            messages=[*MESSAGES, {"role": "assistant", "content": "four five"}],
            extra_body={"add_generation_prompt": False, "continue_final_message": True},
        )
        assert continued.choices[0].message.role == "assistant"
        # echo goes by that role: the continued message's content comes first ...
        echoed = client.chat.completions.create(
            model="fake-model",
            messages=[*MESSAGES, {"role": "assistant", "content": "four five"}],
            extra_body={
                "add_generation_prompt": False,
                "continue_final_message": True,
                "echo": True,
            },
        )
        echoed_content = echoed.choices[0].message.content
        assert echoed_content == "four five" + continued.choices[0].message.content
        # ... and after a generation prompt the reply is --response-role's, which the last
        # message (the user's) does not have, so nothing is echoed
        plain = client.chat.completions.create(
            model="fake-model", messages=MESSAGES, extra_body={"echo": True}
        )
        assert plain.choices[0].message.content == reply.choices[0].message.content
    # a reply in the last message's role echoes it, whichever role --response-role names
    with serving(engine, response_role="user") as (_, client):
        echoed = client.chat.completions.create(
            model="fake-model", messages=MESSAGES, extra_body={"echo": True}
        )
        assert echoed.choices[0].message.role == "user"
        assert echoed.choices[0].message.content.startswith(MESSAGES[-1]["content"])


def test_default_chat_template_kwargs_under_the_requests(engine: FakeEngine) -> None:
    defaults = {"enable_thinking": False, "style": "terse"}
    with serving(engine, default_chat_template_kwargs=defaults) as (live, client):
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
        assert engine.requests[-1].prompt.chat_template_kwargs == defaults  # type: ignore[union-attr]
        client.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            extra_body={"chat_template_kwargs": {"enable_thinking": True, "x": 1}},
        )
        assert engine.requests[-1].prompt.chat_template_kwargs == {  # type: ignore[union-attr]
            "enable_thinking": True,
            "style": "terse",
            "x": 1,
        }
        status, _, _ = raw_request(live, "POST", "/tokenize", {"messages": MESSAGES})
        assert status == 200


def test_generation_config_defaults_fill_what_requests_leave_unset(engine: FakeEngine) -> None:
    defaults = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "min_p": 0.05}
    defaults["repetition_penalty"] = 1.25
    with serving(engine, default_sampling_params=defaults) as (_, client):
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
        sampling = engine.requests[-1].sampling
        assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.25, 0.5, 7)
        assert (sampling.min_p, sampling.repetition_penalty) == (0.05, 1.25)
        client.completions.create(
            model="fake-model", prompt="a b", temperature=0.0, extra_body={"top_k": 2}
        )
        sampling = engine.requests[-1].sampling
        assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.0, 2, 0.5)


def test_max_logprobs(engine: FakeEngine) -> None:
    with serving(engine) as (_, client):  # vLLM's default: 20
        with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20") as info:
            client.chat.completions.create(
                model="fake-model", messages=MESSAGES, logprobs=True, top_logprobs=21
            )
        assert info.value.body["param"] == "top_logprobs"  # type: ignore[index]
        assert client.chat.completions.create(
            model="fake-model", messages=MESSAGES, logprobs=True, top_logprobs=20
        ).choices
    with serving(engine, max_logprobs=30) as (_, client):
        reply = client.chat.completions.create(
            model="fake-model", messages=MESSAGES, logprobs=True, top_logprobs=25
        )
        assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 25  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError, match="max allowed: 30"):
            client.completions.create(model="fake-model", prompt="a b", logprobs=31)
        with pytest.raises(openai.BadRequestError, match="prompt logprobs of 31") as info:
            client.completions.create(
                model="fake-model", prompt="a b", extra_body={"prompt_logprobs": 31}
            )
        assert info.value.body["param"] == "prompt_logprobs"  # type: ignore[index]
        assert client.completions.create(model="fake-model", prompt="a b").choices  # still serving


def test_force_include_usage(engine: FakeEngine) -> None:
    with serving(engine, enable_force_include_usage=True) as (_, client):
        chunks = list(
            client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        )
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 3
        # as vLLM forces it: every chunk carries the usage so far
        assert all(chunk.usage is not None for chunk in chunks)
        text = list(client.completions.create(model="fake-model", prompt="a b", stream=True))
        assert text[-1].usage is not None and text[-1].usage.completion_tokens == 2
    with serving(engine) as (_, client):
        chunks = list(
            client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        )
        assert all(chunk.usage is None for chunk in chunks)


def test_return_tokens_as_token_ids_server_default(engine: FakeEngine) -> None:
    with serving(engine, return_tokens_as_token_ids=True) as (_, client):
        reply = client.chat.completions.create(
            model="fake-model", messages=MESSAGES, logprobs=True, top_logprobs=1
        )
        entry = reply.choices[0].logprobs.content[0]  # type: ignore[union-attr]
        assert entry.token == f"token_id:{engine.word_id('one')}"
        text = client.completions.create(model="fake-model", prompt="a b", logprobs=0)
        assert text.choices[0].logprobs.tokens[0].startswith("token_id:")  # type: ignore[union-attr]
        # vLLM's test_return_tokens_as_ids: echoed, every prompt token too, the first (which has
        # no logprob) included, so that the ids decode to the whole text
        echoed = client.completions.create(
            model="fake-model", prompt="a b", logprobs=1, echo=True, max_tokens=2
        )
        names = echoed.choices[0].logprobs.tokens  # type: ignore[union-attr]
        assert names[0] == f"token_id:{engine.word_id('a')}"
        assert all(name.startswith("token_id:") for name in names)
        # a request's own false wins
        plain = client.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": False},
        )
        assert plain.choices[0].logprobs.content[0].token == "one"  # type: ignore[union-attr]


def test_request_and_output_logs(engine: FakeEngine) -> None:
    with serving(engine) as (_, client), structlog.testing.capture_logs() as quiet:
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert not [e for e in quiet if e["event"] in ("request received", "response generated")]
    options = {"enable_log_requests": True, "enable_log_outputs": True}
    with serving(engine, **options) as (_, client), structlog.testing.capture_logs() as logs:
        reply = client.chat.completions.create(model="fake-model", messages=MESSAGES, seed=3)
    received = next(e for e in logs if e["event"] == "request received")
    assert received["request_id"] == reply.id
    assert received["prompt"]["messages"] == MESSAGES
    assert received["params"]["seed"] == 3
    generated = next(e for e in logs if e["event"] == "response generated")
    assert generated["request_id"] == reply.id
    assert generated["output"] == "one two three"
    assert generated["output_token_ids"] == [engine.word_id(w) for w in ("one", "two", "three")]
    assert generated["finish_reason"] == "stop"
    with (
        serving(engine, enable_log_requests=True) as (_, c),
        structlog.testing.capture_logs() as only,
    ):
        c.completions.create(model="fake-model", prompt="a b")
    events = [e["event"] for e in only]
    assert "request received" in events and "response generated" not in events


CORS_ORIGIN = "https://app.example"


def test_no_cors_headers_unless_configured(engine: FakeEngine) -> None:
    with serving(engine) as (live, _):
        _, headers, _ = raw_request(live, "GET", "/v1/models", headers={"Origin": CORS_ORIGIN})
        assert not [h for h in headers if h.lower().startswith("access-control-")]


def test_cors_preflight_and_responses(engine: FakeEngine) -> None:
    with serving(engine, allowed_origins=(CORS_ORIGIN,), allowed_methods=("GET", "POST")) as (
        live,
        _,
    ):
        preflight = {
            "Origin": CORS_ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        # no API key: browsers send none with a preflight
        status, headers, _ = raw_request(
            live, "OPTIONS", "/v1/chat/completions", headers={**preflight, "Authorization": ""}
        )
        assert status == 200
        assert headers["access-control-allow-origin"] == CORS_ORIGIN
        assert headers["access-control-allow-methods"] == "GET, POST"
        assert headers["access-control-allow-headers"] == "authorization, content-type"
        assert headers["vary"] == "Origin"
        status, headers, body = raw_request(
            live, "OPTIONS", "/v1/models", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert status == 400 and b"Disallowed CORS origin" in body
        assert "access-control-allow-origin" not in headers
        status, _, body = raw_request(
            live,
            "OPTIONS",
            "/v1/models",
            headers={**preflight, "Access-Control-Request-Method": "DELETE"},
        )
        assert status == 400 and b"Disallowed CORS method" in body
        status, headers, _ = raw_request(
            live,
            "POST",
            "/v1/chat/completions",
            {"messages": MESSAGES},
            headers={"Origin": CORS_ORIGIN},
        )
        assert status == 200 and headers["access-control-allow-origin"] == CORS_ORIGIN
        # errors carry it too, so that the page can read them
        status, headers, _ = raw_request(
            live, "GET", "/v1/models", headers={"Origin": CORS_ORIGIN, "Authorization": "Bearer no"}
        )
        assert status == 401 and headers["access-control-allow-origin"] == CORS_ORIGIN
        _, headers, _ = raw_request(
            live, "GET", "/v1/models", headers={"Origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in headers


def test_cors_any_origin_with_credentials(engine: FakeEngine) -> None:
    options = {"allowed_origins": ("*",), "allow_credentials": True, "allowed_headers": ("x-a",)}
    with serving(engine, **options) as (live, _):
        status, headers, _ = raw_request(
            live,
            "OPTIONS",
            "/v1/models",
            headers={
                "Origin": CORS_ORIGIN,
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "X-A",
            },
        )
        assert status == 200
        assert headers["access-control-allow-origin"] == CORS_ORIGIN  # explicit with credentials
        assert headers["access-control-allow-credentials"] == "true"
        assert headers["access-control-allow-headers"] == (
            "accept, accept-language, content-language, content-type, x-a"
        )
        status, _, body = raw_request(
            live,
            "OPTIONS",
            "/v1/models",
            headers={
                "Origin": CORS_ORIGIN,
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "X-B",
            },
        )
        assert status == 400 and b"Disallowed CORS headers" in body
        _, headers, _ = raw_request(live, "GET", "/v1/models", headers={"Origin": CORS_ORIGIN})
        assert headers["access-control-allow-origin"] == "*"


def test_root_path(engine: FakeEngine) -> None:
    with serving(engine, root_path="/llm") as (live, _):
        # behind a proxy that strips the prefix, and one that forwards it
        for base in (f"{live.url}/v1", f"{live.url}/llm/v1"):
            with openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0) as client:
                assert client.chat.completions.create(model="fake-model", messages=MESSAGES)
        assert raw_request(live, "GET", "/llm/health")[0] == 200


def _self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("neither the cryptography package nor the openssl CLI is installed")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


def test_https(engine: FakeEngine, tmp_path: Path) -> None:
    key, cert = _self_signed_certificate(tmp_path)
    with serving(engine, ssl_keyfile=str(key), ssl_certfile=str(cert)) as (live, _):
        base_url = live.url.replace("http://", "https://") + "/v1"
        with (
            openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cert)) as http,
            openai.OpenAI(base_url=base_url, api_key=API_KEY, http_client=http) as client,
        ):
            reply = client.chat.completions.create(model="fake-model", messages=MESSAGES)
            assert reply.choices[0].message.content == "one two three"
        with (
            openai.OpenAI(
                base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=5
            ) as plain,
            pytest.raises(openai.APIConnectionError),
        ):
            plain.models.list()
