"""/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and answers), registered only
when runtime updating is allowed (VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM)."""

from __future__ import annotations

import msgspec
from quart import Blueprint, Response

from server.errors import APIError
from server.openai_serving import decode, openai_serving, read_body
from stages.api import EngineError

lora_routes = Blueprint("lora", __name__)


class LoadLoraAdapterRequest(msgspec.Struct, frozen=True):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # vLLM's: replace the adapter already served under lora_name


class UnloadLoraAdapterRequest(msgspec.Struct, frozen=True):
    lora_name: str = ""
    lora_int_id: int | None = None


@lora_routes.post("/v1/load_lora_adapter")
async def load_lora_adapter() -> Response:
    """vLLM's: check the adapter at `lora_path` and serve it as `lora_name`; 200 with a line of
    text, or an error body (404 where no adapter is found there)."""
    serving = openai_serving()
    body = decode(await read_body(), LoadLoraAdapterRequest, serving.unknown_fields)
    adapters = serving.lora_adapters
    if not adapters.enabled:
        raise APIError("LoRA is not enabled: start the server with --enable-lora", 400)
    adapters.check_new(body.lora_name, body.lora_path, body.load_inplace)
    try:
        await serving.in_worker(lambda: serving.engine.check_lora(body.lora_path))
    except EngineError as error:
        if error.status == 404:  # vLLM's LoRAAdapterNotFoundError words
            message = f"Loading lora {body.lora_name} failed: {error.message}"
            raise APIError(message, 404, "NotFoundError") from error
        raise APIError.from_engine(error) from error
    adapters.add(body.lora_name, body.lora_path, in_place=body.load_inplace)
    return Response(
        f"Success: LoRA adapter '{body.lora_name}' added successfully.",
        status=200,
        content_type="text/plain; charset=utf-8",
    )


@lora_routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter() -> Response:
    serving = openai_serving()
    body = decode(await read_body(), UnloadLoraAdapterRequest, serving.unknown_fields)
    if not body.lora_name and not body.lora_int_id:
        raise APIError(
            "'lora_name' (or 'lora_int_id') needs to be provided to unload a LoRA adapter.",
            400,
            "InvalidUserInput",
        )
    name = body.lora_name or serving.lora_adapters.name_of(body.lora_int_id)
    serving.lora_adapters.remove(name)
    return Response(
        f"Success: LoRA adapter '{name}' removed successfully.",
        status=200,
        content_type="text/plain; charset=utf-8",
    )
