"""vLLM's own entrypoint tests as the parity target (issue 36): run them against pipeline-serve.

    python -m perf.vllm_conformance --vllm PATH [--suite NAME ...] [--json OUT] [-k EXPR]

PATH is a checkout of vLLM's repository (or its sdist, which carries tests/); nothing of it is
copied here and CI does not need it. Each suite is a pytest run rooted at PATH with the plugin
perf/conformance/pipeline_serve_vllm.py, which starts pipeline-serve for each test's server (the
default model under the test's model name). Outcomes are counted as passed, failed on the
server's behaviour, failed only because of the model (perf/conformance/set_aside.toml says which
and why), and skipped with the reason; a table is printed and the JSON written.

The plugin needs pytest-asyncio, which this project's own tests do not use: it is installed once
into --deps (a directory of its own, so the project's environment stays as it is).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = HERE / "conformance"
SET_ASIDE = PLUGIN_DIR / "set_aside.toml"
# What vLLM's test modules import that this project does not install: its async test runner, and
# fastapi / httpx / tblib, imported at the top of some modules. With --no-deps: the rest (pydantic,
# anyio, h11, ...) is this environment's, so the tests' client libraries are the project's own.
DEPENDENCIES = (
    "pytest-asyncio>=1.1,<2",
    "fastapi>=0.133,<0.137",  # vLLM 0.34's range (later ones import opentelemetry at once)
    "starlette>=1.0.1",
    "httpx>=0.27",
    "httpcore>=1.0",
    "tblib>=3.0",
    "pybase64>=1.4",  # imported at the top of the modules that send embeddings and images
)
DEFAULT_DEPS = Path.home() / ".cache" / "pipeline-serve" / "conformance-deps"


@dataclass(frozen=True)
class Suite:
    name: str
    paths: tuple[str, ...]  # under the checkout
    confcutdir: str  # conftests above it (vLLM's model-test machinery) are not loaded
    extra: tuple[str, ...] = ()


# The API's tests (the directories, as vLLM 0.34 lays them out): the top-level files of
# tests/entrypoints/openai are the API tests that earlier releases kept under basic/.
OPENAI_FILES = (
    "test_chunked_prompt.py",
    "test_return_token_ids.py",
    "test_return_tokens_as_ids.py",
    "test_stop_token_ids.py",
    "test_tool_choice_content_none.py",
    "test_session_id.py",
)
SUITES = {
    suite.name: suite
    for suite in (
        Suite(
            "openai",
            (
                "tests/entrypoints/openai/chat_completion",
                "tests/entrypoints/openai/completion",
                *(f"tests/entrypoints/openai/{name}" for name in OPENAI_FILES),
            ),
            "tests/entrypoints",
        ),
        Suite(
            "serve",
            (
                "tests/entrypoints/serve/tokenize",
                "tests/entrypoints/serve/instrumentator",
                "tests/entrypoints/serve/lora",
            ),
            "tests/entrypoints",
        ),
        Suite("tool_use", ("tests/tool_use",), "tests/tool_use", ("-k", "hermes")),
    )
}


@dataclass
class Outcome:
    nodeid: str
    outcome: str  # passed, failed-server, failed-model, skipped
    reason: str = ""


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    dropped_flags: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


def ensure_dependencies(deps: Path) -> None:
    """pytest-asyncio in `deps` (installed there once, from PyPI)."""
    marker = deps / "installed.json"
    if marker.exists() and json.loads(marker.read_text()) == list(DEPENDENCIES):
        return
    print(f"installing {', '.join(DEPENDENCIES)} into {deps} (once)", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
         str(deps), *DEPENDENCIES],
        check=True,
    )  # fmt: skip
    marker.write_text(json.dumps(list(DEPENDENCIES)))


def server_flags() -> dict[str, bool]:
    """pipeline-serve's option strings, and whether each takes a value."""
    from server.options import build_parser

    flags: dict[str, bool] = {}
    for action in build_parser()._actions:
        for option in action.option_strings:
            flags[option] = action.nargs != 0
    return flags


def set_aside() -> list[dict[str, str]]:
    entries: list[dict[str, str]] = tomllib.loads(SET_ASIDE.read_text())["set_aside"]
    return entries


def classify(records: list[dict[str, Any]], aside: list[dict[str, str]]) -> list[Outcome]:
    """One outcome per test (its worst phase), failures matched against the set-aside list."""
    worst: dict[str, dict[str, Any]] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for record in records:
        if record["kind"] != "test":
            continue
        seen = worst.get(record["nodeid"])
        if seen is None or rank[record["outcome"]] > rank[seen["outcome"]]:
            worst[record["nodeid"]] = record
    outcomes = []
    for nodeid, record in worst.items():
        kind = record["outcome"]
        reason = record["reason"]
        if kind == "failed":
            entry = next((e for e in aside if fnmatch.fnmatch(nodeid, e["test"])), None)
            if entry is None:
                kind = "failed-server"
            else:  # a test of vLLM's own code that the stand-ins cannot skip, or the model's
                kind = "skipped" if entry.get("kind") == "internal" else "failed-model"
                reason = entry["reason"]
        outcomes.append(Outcome(nodeid, kind, reason))
    return outcomes


def run_suite(
    checkout: Path,
    suite: Suite,
    model: str,
    deps: Path,
    keyword: str | None,
    source: Path,
    max_new_tokens: int = 0,
) -> Run:
    from stages.text.checkpoint import load_model_config

    shape = load_model_config(model)
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as report:
        report_path = report.name
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join((str(deps), str(PLUGIN_DIR))),
        "PIPELINE_SERVE_CMD": json.dumps([sys.executable, "-m", "server.cli", "serve"]),
        "PIPELINE_SERVE_MODEL": model,
        "PIPELINE_SERVE_FLAGS": json.dumps(server_flags()),
        "PIPELINE_SERVE_REPORT": report_path,
        "PIPELINE_SERVE_SHAPE": json.dumps(
            {
                "hidden_size": shape.hidden_size,
                "num_layers": shape.num_layers,
                "num_heads": shape.num_heads,
                "num_kv_heads": shape.num_kv_heads,
                "head_dim": shape.head_dim,
            }
        ),
        # the server runs from `source`, whatever the pytest run's directory
        "PIPELINE_SERVE_SOURCE": str(source),
        "PIPELINE_SERVE_MAX_NEW_TOKENS": str(max_new_tokens or ""),
    }
    command = [
        sys.executable, "-m", "pytest", *suite.paths,
        "-p", "pipeline_serve_vllm", "-p", "no:cacheprovider",
        f"--confcutdir={suite.confcutdir}", "-o", "addopts=", "-q", "-rN",
        "--continue-on-collection-errors", "--tb=native",
        *suite.extra,
    ]  # fmt: skip
    if keyword:
        command += ["-k", keyword]
    started = time.monotonic()
    subprocess.run(command, cwd=checkout, env=env, check=False)
    records = [json.loads(line) for line in Path(report_path).read_text().splitlines() if line]
    os.unlink(report_path)
    run = Run(classify(records, set_aside()), seconds=time.monotonic() - started)
    for record in records:
        if record["kind"] == "server":
            run.dropped_flags.update(set(record["dropped"]))
    return run


def summary(runs: dict[str, Run]) -> dict[str, Any]:
    kinds = ("passed", "failed-server", "failed-model", "skipped")
    table = {
        name: {kind: sum(o.outcome == kind for o in run.outcomes) for kind in kinds}
        | {"seconds": round(run.seconds)}
        for name, run in runs.items()
    }
    return {
        "suites": table,
        "failed_server": [
            {"test": o.nodeid, "reason": o.reason}
            for run in runs.values()
            for o in run.outcomes
            if o.outcome == "failed-server"
        ],
        "failed_model": sorted(
            {o.nodeid for run in runs.values() for o in run.outcomes if o.outcome == "failed-model"}
        ),
        "skipped_reasons": Counter(
            o.reason.split(":")[0]
            for run in runs.values()
            for o in run.outcomes
            if o.outcome == "skipped"
        ).most_common(),
        "dropped_flags": sorted({flag for run in runs.values() for flag in run.dropped_flags}),
    }


def print_summary(result: dict[str, Any]) -> None:
    kinds = ("passed", "failed-server", "failed-model", "skipped")
    print(f"\n{'suite':10} " + " ".join(f"{k:>13}" for k in kinds) + f" {'seconds':>8}")
    totals = Counter[str]()
    for name, row in result["suites"].items():
        totals.update({k: row[k] for k in kinds})
        print(f"{name:10} " + " ".join(f"{row[k]:>13}" for k in kinds) + f" {row['seconds']:>8}")
    print(f"{'all':10} " + " ".join(f"{totals[k]:>13}" for k in kinds))
    if result["failed_server"]:
        print("\nfailed on the server's behaviour:")
        for item in result["failed_server"]:
            print(f"  {item['test']}\n      {item['reason'][:200]}")
    print("\nskipped, by reason:", ", ".join(f"{r} ({n})" for r, n in result["skipped_reasons"]))
    print("flags the tests pass that the server lacks:", " ".join(result["dropped_flags"]))
    if result.get("max_new_tokens"):
        print(f"each server capped a request's new tokens at {result['max_new_tokens']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.vllm_conformance", description=__doc__)
    parser.add_argument("--vllm", type=Path, required=True, help="a checkout of vLLM")
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="default: all")
    parser.add_argument("--model", help="the checkpoint served (default: the default model)")
    parser.add_argument("--deps", type=Path, default=DEFAULT_DEPS, help="pytest-asyncio's home")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument(
        "--server-source",
        type=Path,
        default=HERE.parent,
        help="the pipeline-serve tree the servers run (default: this one; another checkout "
        "gives a before/after)",
    )
    parser.add_argument("-k", dest="keyword", help="pytest's -k, within the suites")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=512,
        help="each server's cap on a request's new tokens (vLLM's --override-generation-config "
        "max_new_tokens) unless the test sets a generation config; 0: none. Tests that set no "
        "max_tokens otherwise write up to the whole context (8k tokens on 2 cores)",
    )
    args = parser.parse_args(argv)
    if not (args.vllm / "tests" / "entrypoints").is_dir():
        parser.error(f"{args.vllm} has no tests/entrypoints: give a checkout of vLLM")
    from stages.config import default_model_path

    model = args.model or default_model_path()
    ensure_dependencies(args.deps)
    runs = {
        name: run_suite(
            args.vllm.resolve(),
            SUITES[name],
            model,
            args.deps,
            args.keyword,
            args.server_source,
            args.max_new_tokens,
        )
        for name in args.suite or SUITES
    }
    result = summary(runs) | {"max_new_tokens": args.max_new_tokens}
    print_summary(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
