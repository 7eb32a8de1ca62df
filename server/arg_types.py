"""The value types of pipeline-serve's flags: each turns a flag's text into its value or says,
as argparse's error, what is wrong with it."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

from stages.cpu_bind import check_setting
from stages.lora import LoraError, LoraModule
from stages.speculative_config import SpeculativeConfig

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_bytes(text: str) -> int:
    """Byte sizes: 512MiB, 4GiB, 1.5G (bare K/M/G/T are binary), 2GB (decimal), 1000."""
    match = _BYTES.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 512MiB or 4GiB)")
    number, prefix, binary, byte_suffix = match.groups()
    power = _POWERS[prefix.lower()]
    decimal = prefix != "" and binary == "" and byte_suffix != ""  # KB, MB, GB: powers of 1000
    return int(float(number) * (1000 if decimal else 1024) ** power)


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def seconds_parser(zero_allowed: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        # `not value >= 0` also refuses nan
        if not (value >= 0 if zero_allowed else 0 < value < float("inf")):
            bound = "at least 0" if zero_allowed else "a positive number of seconds"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
seconds = seconds_parser(zero_allowed=True)
positive_seconds = seconds_parser(zero_allowed=False)


def port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def check_cpu_binding(text: str) -> str:
    """--cpu-threads-bind: none, auto or a list of cores such as 0-3,6."""
    try:
        return check_setting(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error} (or none, or auto)") from None


def json_of(kind: type, description: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({error})") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"not {description}: {text!r}")
        return value

    return parse


json_object = json_of(dict, "a JSON object")
json_list = json_of(list, "a JSON list")


def mm_limits(text: str) -> dict[str, Any]:
    """vLLM's --limit-mm-per-prompt: each modality's most items a prompt may carry, a count or
    an object of options with its count, e.g. {"image": 2, "video": {"count": 1}}."""
    limits = json_object(text)
    for modality, limit in limits.items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise argparse.ArgumentTypeError(
                f"{modality!r}: a count of 0 or more (or an object with one) is needed, "
                f"got {limit!r}"
            )
    return limits


def load_chat_template(value: str) -> str:
    """vLLM's rule for --chat-template: the file's text when the value names a file; else the
    value itself, if it looks like a template (it has one of `{`, `}` or a newline)."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        if not any(char in value for char in "{}\n"):
            raise argparse.ArgumentTypeError(
                f"the chat template {value!r} looks like a file path, but it could not be "
                f"opened: {error}"
            ) from None
        return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def lora_module(text: str) -> LoraModule:
    try:
        return LoraModule.parse(text)
    except LoraError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _typed_keys(text: str, types: dict[str, type], flag: str) -> dict[str, Any]:
    """A JSON object whose keys are among `types`, each value of its type."""
    config = json_object(text)
    for key, value in config.items():
        expected = types.get(key)
        if expected is None:
            raise argparse.ArgumentTypeError(
                f"{flag} has no key {key!r}; its keys: {', '.join(sorted(types))}"
            )
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise argparse.ArgumentTypeError(
                f"{flag}'s {key} must be a {expected.__name__}, got {value!r}"
            )
    return config


# vLLM's StructuredOutputsConfig: its keys and their types
STRUCTURED_OUTPUTS_KEYS: dict[str, type] = {
    "backend": str,
    "disable_fallback": bool,
    "disable_any_whitespace": bool,
    "disable_additional_properties": bool,
    "reasoning_parser": str,
    "reasoning_parser_plugin": str,
    "enable_in_reasoning": bool,
}
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


def structured_outputs_config(text: str) -> dict[str, Any]:
    """vLLM's --structured-outputs-config, checked: known keys, values of their types, a backend
    vLLM names (what the server makes of them: server/vllm_configs.py)."""
    config = _typed_keys(text, STRUCTURED_OUTPUTS_KEYS, "--structured-outputs-config")
    backend = config.get("backend", "auto")
    if backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"backend {backend!r} is not one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}"
        )
    return config


# vLLM's ReasoningConfig: the texts thinking_token_budget opens and forces
REASONING_KEYS: dict[str, type] = {
    "reasoning_parser": str,
    "reasoning_start_str": str,
    "reasoning_end_str": str,
}


def reasoning_config(text: str) -> dict[str, Any]:
    return _typed_keys(text, REASONING_KEYS, "--reasoning-config")
