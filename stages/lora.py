"""LoRA adapters as the engine takes them, torch-free: the limits (--max-loras and friends), the
--lora-modules syntax, and a PEFT adapter directory read and checked against the model (its
config and its safetensors header, not its tensors) before any request may name it."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from stages.text.checkpoint import ModelConfig

# The projections an adapter may target: attention and MLP (PEFT's names, Hugging Face's modules).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# vLLM's --max-lora-rank choices.
SUPPORTED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

_TENSOR_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class LoraError(ValueError):
    """An adapter this server cannot serve, or a malformed --lora-modules entry; `not_found` when
    the path holds no adapter (vLLM answers that one 404)."""

    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


# vLLM's --lora-dtype choices
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """vLLM's --max-loras (adapters one step may mix: execute's weight slots), --max-lora-rank and
    --max-cpu-loras (adapters execute keeps loaded in host memory, least recently used out)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # vLLM's --lora-dtype: the adapter slots' dtype; "auto": the base model's
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        if self.max_lora_rank not in SUPPORTED_RANKS:
            raise ValueError(
                f"--max-lora-rank must be one of {', '.join(map(str, SUPPORTED_RANKS))}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("--max-cpu-loras must be at least --max-loras")
        if self.dtype not in LORA_DTYPES:
            raise ValueError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One --lora-modules entry: `name=path`, or vLLM's JSON {"name", "path", "base_model_name"}."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoraModule:
        text = text.strip()
        if text.startswith("{"):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as error:
                raise LoraError(f"--lora-modules {text!r}: not JSON ({error})") from error
            if not isinstance(raw, dict) or not {"name", "path"} <= raw.keys():
                raise LoraError(f"--lora-modules {text!r}: a JSON entry needs 'name' and 'path'")
            extra = raw.keys() - {"name", "path", "base_model_name"}
            if extra:
                raise LoraError(f"--lora-modules {text!r}: unknown keys {sorted(extra)}")
            base = raw.get("base_model_name")
            if not all(isinstance(v, str) and v for v in (raw["name"], raw["path"])):
                raise LoraError(f"--lora-modules {text!r}: 'name' and 'path' must be strings")
            return cls(raw["name"], raw["path"], base if isinstance(base, str) else None)
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise LoraError(f"--lora-modules {text!r}: expected name=path or a JSON object")
        return cls(name, path)


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What an adapter directory holds, checked: its rank, its scaling and what it targets."""

    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: frozenset[str]
    layers: frozenset[int]  # the layers it has tensors for


def read_adapter(path: str, model: ModelConfig, max_rank: int) -> AdapterSpec:
    """The PEFT adapter at `path`, refused with a LoraError that says why when this server cannot
    apply it exactly: not LoRA, DoRA, a bias, extra trained modules (embeddings, the LM head),
    per-module ranks, a rank over `max_rank`, a module or layer the model lacks, wrong shapes."""
    config_path = os.path.join(path, ADAPTER_CONFIG)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(config_path) or not os.path.isfile(weights_path):
        raise LoraError(
            f"No adapter found for {path}: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}",
            not_found=True,
        )
    try:
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise LoraError(f"adapter {path}: unreadable {ADAPTER_CONFIG} ({error})") from error
    if not isinstance(config, dict):
        raise LoraError(f"adapter {path}: {ADAPTER_CONFIG} is not a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {path}: peft_type {config.get('peft_type')!r} is not LORA")
    feature = _unsupported_feature(config)
    if feature is not None:
        raise LoraError(f"adapter {path}: {feature}")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapter {path}: LoRA biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise LoraError(
            f"adapter {path}: Unsupported modules_to_save: {config['modules_to_save']} (fully "
            "trained modules, such as embeddings or the LM head)"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraError(
            f"adapter {path}: per-module ranks (rank_pattern, alpha_pattern) are not supported"
        )
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"adapter {path}: r and lora_alpha must be numbers, r at least 1")
    if rank > max_rank:
        raise LoraError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    unsupported = sorted(set(names) - set(TARGET_MODULES))
    if unsupported or not names:
        raise LoraError(
            f"adapter {path}: target_modules {unsupported or names} are not supported; "
            f"this server applies adapters to {', '.join(TARGET_MODULES)}"
        )
    layers = _check_tensors(path, weights_path, model, rank, set(names))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterSpec(rank, float(scaling), frozenset(names), frozenset(layers))


# PEFT inits that only set the adapter's first weights: the saved adapter is a plain LoRA (vLLM's
# list). The others (PiSSA, OLoRA, CorDA, LoftQ) also change the base model's weights.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def _unsupported_feature(config: dict[str, Any]) -> str | None:
    """What of an adapter's config no plain LoRA update reproduces, in vLLM's words."""
    if config.get("use_dora"):
        return "this server does not yet support DoRA (use_dora)"
    if config.get("lora_bias"):
        return "this server does not support LoRA bias (lora_bias)"
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        return (
            f"this server does not support init_lora_weights={init!r}: inits such as PiSSA, "
            "OLoRA, CorDA and LoftQ modify the base model's weights. Convert it to a regular LoRA "
            "adapter with PEFT's path_initial_model_for_weight_conversion, or set "
            "init_lora_weights to true if the served base model already holds the modified weights"
        )
    for key, name in (
        ("alora_invocation_tokens", "Activated LoRA (aLoRA)"),
        ("layer_replication", "layer_replication"),
        ("use_bdlora", "block-diagonal LoRA (BD-LoRA)"),
        ("use_qalora", "QALoRA"),
    ):
        if config.get(key):
            return f"this server does not support {name}"
    return None


def module_shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a projection."""
    hidden, inter = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (model.q_size, hidden),
        "k_proj": (model.kv_size, hidden),
        "v_proj": (model.kv_size, hidden),
        "o_proj": (hidden, model.q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[module]


def _check_tensors(
    path: str, weights_path: str, model: ModelConfig, rank: int, targets: set[str]
) -> set[int]:
    """Every tensor of the safetensors header is a lora_A [r, in] or lora_B [out, r] of a targeted
    module in one of the model's layers, A and B in pairs; the layers found."""
    header = _safetensors_header(weights_path)
    pairs: dict[tuple[int, str], set[str]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        match = _TENSOR_RE.match(name)
        if match is None:
            raise LoraError(
                f"adapter {path}: tensor {name!r} is not a LoRA weight of an attention or MLP "
                "projection (embedding and LM head adapters are not supported)"
            )
        layer, module, side = int(match.group(1)), match.group(3), match.group(4)
        if module not in targets:
            raise LoraError(f"adapter {path}: tensor {name!r} is of a module not in target_modules")
        if layer >= model.num_layers:
            raise LoraError(
                f"adapter {path}: layer {layer} of {name!r}; the model has {model.num_layers}"
            )
        out_features, in_features = module_shape(model, module)
        expected = [rank, in_features] if side == "A" else [out_features, rank]
        shape = info.get("shape") if isinstance(info, dict) else None
        if shape != expected:
            raise LoraError(
                f"adapter {path}: tensor {name!r} has shape {shape}, expected {expected}"
                " (an adapter of another model?)"
            )
        pairs.setdefault((layer, module), set()).add(side)
    unpaired = [key for key, sides in pairs.items() if sides != {"A", "B"}]
    if unpaired:
        raise LoraError(f"adapter {path}: lora_A and lora_B come in pairs; {unpaired[0]} has one")
    if not pairs:
        raise LoraError(f"adapter {path}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return {layer for layer, _ in pairs}


def _safetensors_header(path: str) -> dict[str, object]:
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}}."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > 100 * 1024 * 1024:
                raise ValueError("header too long")
            header = json.loads(file.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise LoraError(f"adapter {path}: not a safetensors file ({error})") from error
    if not isinstance(header, dict):
        raise LoraError(f"adapter {path}: not a safetensors file")
    return header
