"""LoRA adapters as clients see them (vLLM's OpenAIServingModels): the served adapters by name,
each a `model` a request may name and a card of /v1/models."""

from __future__ import annotations

from dataclasses import dataclass

from server.errors import APIError
from stages.api import LoraRequest
from stages.lora import LoraModule


@dataclass(slots=True, frozen=True)
class ServedAdapter:
    request: LoraRequest
    parent: str  # the base model's served name (/v1/models' `parent`)


class LoraAdapters:
    """The adapters served under their names, each with a unique id for the server's life (a name
    unloaded and loaded again is a new adapter: its cached prefixes are not the old one's)."""

    def __init__(self, base_names: tuple[str, ...], enabled: bool) -> None:
        self.base_names = base_names
        self.enabled = enabled
        self.by_name: dict[str, ServedAdapter] = {}
        self._last_id = 0

    def get(self, name: str) -> LoraRequest | None:
        served = self.by_name.get(name)
        return None if served is None else served.request

    def check_new(self, name: str, path: str, in_place: bool = False) -> None:
        """APIError 400 (vLLM's words) unless `name` and `path` are given and the name is free, or
        taken by an adapter that `in_place` replaces."""
        if not name or not path:
            raise APIError(
                "Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput"
            )
        if name in self.base_names:
            raise APIError(
                f"The lora adapter '{name}' conflicts with a served base model.",
                400,
                "InvalidUserInput",
            )
        if name in self.by_name and not in_place:
            raise APIError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                400,
                "InvalidUserInput",
            )

    def add(
        self, name: str, path: str, base_model_name: str | None = None, in_place: bool = False
    ) -> LoraRequest:
        """Serve the adapter at `path` (already checked) as `name`. In place of one served as
        `name`, it takes a new id: requests running with the old one finish with its weights, and
        no cached prefix computed with them is reused."""
        self.check_new(name, path, in_place)
        self._last_id += 1
        request = LoraRequest(name=name, lora_id=self._last_id, path=path)
        # (server/cli.py refuses a base_model_name that names no served model)
        parent = base_model_name if base_model_name in self.base_names else self.base_names[0]
        self.by_name[name] = ServedAdapter(request, parent)
        return request

    def name_of(self, lora_id: int | None) -> str:
        """The name of the adapter with this id; "" for none."""
        found = (n for n, a in self.by_name.items() if a.request.lora_id == lora_id)
        return next(found, "")

    def remove(self, name: str) -> None:
        """Stop serving `name`; requests already running with it finish with it."""
        if name not in self.by_name:
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        del self.by_name[name]

    @classmethod
    def of(
        cls, base_names: tuple[str, ...], enabled: bool, modules: tuple[LoraModule, ...]
    ) -> LoraAdapters:
        """The adapters of --lora-modules, in order (checked at start by the CLI)."""
        adapters = cls(base_names, enabled)
        for module in modules:
            adapters.add(module.name, module.path, module.base_model_name)
        return adapters
