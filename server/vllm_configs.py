"""vLLM's JSON config flags as `vllm serve` takes them: the dotted form (`--X.key value`), and
what --structured-outputs-config and --reasoning-config mean beside the other flags.

Every grammar here is compiled by llguidance (vLLM's `guidance` backend); with a reasoning parser
it holds once the reasoning has ended, or with `enable_in_reasoning: true` from the first token,
as in vLLM. What this server cannot do as asked stops the start with the reason, and a backend it
serves with llguidance instead is logged at start and shown in /metrics
(`vllm:structured_outputs_info`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import structlog

log = structlog.get_logger("pipeline_serve.server")

# The flags whose value is a JSON object of vLLM's config keys: `--X.key value` (or
# `--X.key=value`) sets one key, as vLLM's argument parser allows.
DOTTED_CONFIGS = ("--speculative-config", "--structured-outputs-config", "--reasoning-config")
SERVED_BACKEND = "guidance"  # vLLM's name for llguidance


def merge_dotted(argv: Sequence[str]) -> list[str]:
    """`argv` with each config's dotted keys folded into one `--X JSON` (keys given dotted win
    over the same keys of an `--X JSON` given too). A value is read as JSON when it is JSON
    (true, 4, "x"), else taken as the string it is."""
    rest: list[str] = []
    keys: dict[str, dict[str, Any]] = {}
    whole: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, inline, value = arg.partition("=")
        base, dot, key = flag.partition(".")
        if base in DOTTED_CONFIGS and (dot or flag == base):
            if not inline:
                if i + 1 >= len(argv):
                    rest.append(arg)  # argparse says what is missing
                    break
                value = argv[i + 1]
                i += 1
            if dot:
                keys.setdefault(base, {})[key] = _json_or_text(value)
            else:
                whole[base] = value
            i += 1
            continue
        rest.append(arg)
        i += 1
    for base in DOTTED_CONFIGS:
        if base in keys:
            try:
                given = json.loads(whole.get(base, "{}"))
            except json.JSONDecodeError:
                given = None
            if isinstance(given, dict):
                whole[base] = json.dumps({**given, **keys[base]})
        if base in whole:
            rest += [base, whole[base]]
    return rest


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def resolve_reasoning(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--reasoning-parser, or the reasoning_parser key of either config (vLLM's three ways of
    saying it); two that differ stop the start."""
    named = {
        "--reasoning-parser": args.reasoning_parser,
        "--reasoning-config": (args.reasoning_config or {}).get("reasoning_parser"),
        "--structured-outputs-config": (args.structured_outputs_config or {}).get(
            "reasoning_parser"
        ),
    }
    given = {flag: name for flag, name in named.items() if name}
    if len(set(given.values())) > 1:
        parser.error(f"two reasoning parsers named: {given}")
    name = next(iter(given.values()), None)
    choices = _reasoning_parsers(parser)
    if name is not None and name not in choices:
        parser.error(f"unknown reasoning parser {name!r}; this server has {', '.join(choices)}")
    args.reasoning_parser = name


def _reasoning_parsers(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if "--reasoning-parser" in action.option_strings:
            return list(action.choices or ())
    return []


def check_structured_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The backend asked for (vLLM's `auto` when none); what cannot be honoured stops the start."""
    config = args.structured_outputs_config or {}
    if config.get("disable_additional_properties"):
        parser.error(
            "--structured-outputs-config disable_additional_properties is not supported: "
            "schemas are compiled as they are written"
        )
    if config.get("reasoning_parser_plugin"):
        parser.error("--structured-outputs-config reasoning_parser_plugin: plugins are not loaded")
    backend: str = config.get("backend", "auto")
    if backend not in ("auto", SERVED_BACKEND):
        log.warning(
            "structured outputs are compiled by llguidance (vLLM's guidance backend), not the "
            "backend asked for",
            requested=backend,
            backend=SERVED_BACKEND,
        )
    return backend
