"""GET /openapi.json: a valid OpenAPI 3.1 document of every route, its bodies' schemas from the
request types the handlers decode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema
import msgspec
import pytest
from openapi_spec_validator import validate
from quart import Quart

from server.schemas import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.anyio

ROUTES = {
    ("/v1/chat/completions", "post"),
    ("/v1/completions", "post"),
    ("/v1/chat/completions/render", "post"),
    ("/v1/chat/completions/batch", "post"),
    ("/v1/completions/render", "post"),
    ("/v1/models", "get"),
    ("/v1/models/{model_id}", "get"),
    ("/health", "get"),
    ("/ping", "get"),
    ("/ping", "post"),
    ("/version", "get"),
    ("/tokenize", "post"),
    ("/detokenize", "post"),
    ("/invocations", "post"),
    ("/load", "get"),
    ("/reset_prefix_cache", "post"),
    ("/metrics", "get"),
    ("/debug/profile", "get"),
    ("/openapi.json", "get"),
}
BODIES = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/chat/completions/render": "ChatCompletionRequest",
    "/v1/chat/completions/batch": "BatchChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/completions/render": "CompletionRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}


async def document(app: Quart, **headers: str) -> dict[str, Any]:
    response = await app.test_client().get("/openapi.json", headers=headers)
    assert response.status_code == 200 and response.content_type == "application/json"
    body: dict[str, Any] = msgspec.json.decode(await response.get_data())
    return body


async def test_a_valid_openapi_31_document_of_every_route(app: Quart) -> None:
    doc = await document(app)
    validate(doc)  # raises on an invalid document
    assert doc["openapi"] == "3.1.0" and doc["info"]["title"] == "pipeline-serve"
    listed = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert listed == ROUTES
    served = {
        (rule.rule.replace("<path:model_id>", "{model_id}"), method.lower())
        for rule in app.url_map.iter_rules()
        if rule.endpoint != "static"
        for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}
    }
    assert listed == served
    for path, item in doc["paths"].items():
        body = item.get("post", {}).get("requestBody")
        if path in BODIES:
            schema = body["content"]["application/json"]["schema"]
            assert schema == {"$ref": f"#/components/schemas/{BODIES[path]}"}
        else:
            assert body is None, path
    assert "securitySchemes" not in doc["components"]  # no --api-key: nothing is guarded


async def test_the_request_schemas_have_every_field_the_server_takes(app: Quart) -> None:
    schemas = (await document(app))["components"]["schemas"]
    for kind in (ChatCompletionRequest, CompletionRequest):
        schema = schemas[kind.__name__]
        fields = {f.name for f in msgspec.structs.fields(kind)}
        assert set(schema["properties"]) == fields
        assert fields >= {"model", "max_tokens", "temperature", "stream", "top_k", "min_p"}
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    assert {"tools", "tool_choice", "response_format", "max_completion_tokens"} <= set(
        chat["properties"]
    )
    assert chat["properties"]["temperature"]["anyOf"][0] == {
        "type": "number",
        "minimum": 0.0,
        "maximum": 2.0,
    }


async def test_the_schema_refuses_what_the_server_refuses(app: Quart) -> None:
    doc = await document(app)
    validator = jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/ChatCompletionRequest", "components": doc["components"]}
    )
    good = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    validator.validate(good)
    client = app.test_client()
    assert (await client.post("/v1/chat/completions", json=good)).status_code == 200
    for bad in (
        {**good, "temperature": 2.5},
        {**good, "max_tokens": 0},
        {**good, "stream_options": {"include_usage": "yes"}},
        {"model": "fake-model"},
    ):
        assert not validator.is_valid(bad), bad
        assert (await client.post("/v1/chat/completions", json=bad)).status_code == 400


async def test_with_an_api_key_the_guarded_routes_say_so(make_app: Callable[..., Quart]) -> None:
    app = make_app(api_key="sk-right")
    doc = await document(app)  # the document itself is open, as vLLM's is
    validate(doc)
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    guarded = {
        (path, method)
        for path, item in doc["paths"].items()
        for method, operation in item.items()
        if operation.get("security") == [{"bearer": []}]
    }
    assert {("/v1/chat/completions", "post"), ("/tokenize", "post")} <= guarded
    assert {("/reset_prefix_cache", "post"), ("/v1/models/{model_id}", "get")} <= guarded
    assert not guarded & {("/health", "get"), ("/ping", "get"), ("/metrics", "get")}
    assert ("/openapi.json", "get") not in guarded
