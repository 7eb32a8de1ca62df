"""pytest plugin that runs vLLM's own entrypoint tests against pipeline-serve (issue 36).

Loaded by perf/vllm_conformance.py into a pytest run rooted at a checkout of vLLM, it stands in
for the three things those tests take from vLLM itself:

* `tests.utils.RemoteOpenAIServer` starts `pipeline-serve` (not `vllm serve`) with the test's
  flags, the ones this server lacks dropped and recorded, the test's model name served by the
  default model;
* `vllm.*` imports resolve to stand-in modules: `vllm.tokenizers.get_tokenizer` is the served
  model's tokenizer (transformers), anything else is an object whose use skips the test as a
  unit test of vLLM's internals;
* `huggingface_hub.snapshot_download` (no network here) gives a LoRA adapter of the served model
  (a zero-B PEFT adapter: the base model's outputs under the adapter's name) for a LoRA repo, and
  fails for anything else.

Configuration comes from the environment the runner sets: PIPELINE_SERVE_CMD (JSON argv of the
server), PIPELINE_SERVE_MODEL (the served checkpoint), PIPELINE_SERVE_FLAGS (JSON: the server's
option strings and whether each takes a value), PIPELINE_SERVE_REPORT (where to write the
per-test outcomes and the dropped flags, as JSON lines).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import unittest.mock
from pathlib import Path
from typing import Any

import pytest

SERVER_START_S = 300.0
# Flags whose value describes the test's own model, not the API under test: dropped so that
# the substituted model runs as it is (its GGUF's quantized weights, its own context).
MODEL_FLAGS = frozenset({"--dtype", "--quantization", "--tokenizer", "--hf-overrides"})
INTERNAL = "vLLM internals"


def _report(record: dict[str, Any]) -> None:
    path = os.environ.get("PIPELINE_SERVE_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


# --- vllm.* stand-ins -----------------------------------------------------------------------


_in_test = False  # True while a test (its fixtures included) runs


class _Internal:
    """What a `vllm.*` name is here: using it in a test skips the test (it tests vLLM's code,
    not its API). At import time (a decorator, a base class, a module constant) it stands in
    quietly, so that a module's HTTP tests still run beside its unit tests."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if isinstance(cls, _Internal):  # `X.__new__(X)`: a test building one of vLLM's objects
            return cls._use()
        return super().__new__(cls)

    def __init__(self, name: str) -> None:
        self._name = name

    def _use(self, *args: Any, **kwargs: Any) -> Any:
        if _in_test:
            pytest.skip(f"{INTERNAL}: uses {self._name}")
        return _Internal(f"{self._name}()")

    __call__ = _use
    __getitem__ = _use
    # a module constant of vLLM's (an env default, a limit) in a test's arithmetic
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _use
    __truediv__ = __floordiv__ = __lt__ = __le__ = __gt__ = __ge__ = _use

    def __iter__(self) -> Any:
        self._use()
        return iter(())

    def __enter__(self) -> Any:
        return self._use()

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Internal(f"{self._name}.{attribute}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (_InternalBase,)

    def __or__(self, other: Any) -> Any:  # used in annotations: `X | None`
        return self

    __ror__ = __or__


class _InternalBase:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _in_test:
            pytest.skip(f"{INTERNAL}: subclasses a vllm class")

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Internal(f"{type(self).__name__}.{attribute}")


def _tokenizer(tokenizer_name: str = "", *args: Any, **kwargs: Any) -> Any:
    """vllm.tokenizers.get_tokenizer: whatever the test names, the served model's tokenizer."""
    from transformers import AutoTokenizer

    global _served_tokenizer
    if _served_tokenizer is None:
        model = Path(os.environ["PIPELINE_SERVE_MODEL"])
        if model.suffix == ".gguf":
            _served_tokenizer = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
        else:
            _served_tokenizer = AutoTokenizer.from_pretrained(str(model))
    return _served_tokenizer


_served_tokenizer: Any = None


class _HubApi:
    """vllm.transformers_utils.repo_utils.hf_api(): a conftest's download of the test's model
    ahead of the server is nothing to do here (the served model is on disk); a LoRA repo is
    still built as one."""

    def snapshot_download(self, repo_id: str, *args: Any, **kwargs: Any) -> str | None:
        return _lora_adapter(repo_id) if _is_adapter(repo_id) else None


class _Platform:
    """vllm.platforms.current_platform as a test asks it where it runs: a CPU, no GPU."""

    device_type = "cpu"

    def is_rocm(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return True

    def is_xpu(self) -> bool:
        return False

    def device_count(self) -> int:
        return 0

    def supports_fp8(self) -> bool:
        return False


_KNOWN = {
    "vllm.platforms": {"current_platform": _Platform()},
    "vllm.transformers_utils.repo_utils": {"hf_api": _HubApi},
    "vllm.tokenizers": {"get_tokenizer": _tokenizer},
    "vllm.transformers_utils.tokenizer": {"get_tokenizer": _tokenizer},
    "vllm.version": {"__version__": "pipeline-serve"},
}


def _error_init(self: Exception, *args: Any, **kwargs: Any) -> None:
    """vLLM's errors take keywords (parameter=...); the stand-in keeps the message."""
    Exception.__init__(self, *args)


def _mock_add_spec(original: Any) -> Any:
    """unittest.mock with a vllm class as spec (a mock of vLLM's serving objects) tests vLLM's
    code, not its API: the test skips, as one that uses the class does."""

    def add_spec(self: Any, spec: Any, *args: Any, **kwargs: Any) -> Any:
        if _in_test and isinstance(spec, _Internal):
            pytest.skip(f"{INTERNAL}: mocks {spec._name}")
        return original(self, spec, *args, **kwargs)

    return add_spec


class _StandInModule(types.ModuleType):
    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        if attribute.endswith(("Error", "Exception")):
            # a real class, so that `pytest.raises(X)` and `class Y(X)` take it; nothing here
            # raises it, so a test that expects it from vLLM's own code skips on that code
            error = type(
                attribute,
                (Exception,),
                {"__module__": self.__name__, "__init__": _error_init},
            )
            setattr(self, attribute, error)
            return error
        return _Internal(f"{self.__name__}.{attribute}")


class _VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every `vllm` and `vllm.*` module is a stand-in (vLLM itself is not installed here)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        for name, value in _KNOWN.get(spec.name, {}).items():
            setattr(module, name, value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


# --- the server -------------------------------------------------------------------------------


def _flags() -> dict[str, bool]:
    """The server's option strings -> whether each takes a value."""
    known: dict[str, bool] = json.loads(os.environ.get("PIPELINE_SERVE_FLAGS", "{}"))
    return known


def map_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(the flags pipeline-serve takes, those it lacks or that describe the test's model)."""
    known = _flags()
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        arg = str(args[i])
        name, has_inline, _ = arg.partition("=")
        # vLLM's dotted form of a JSON config flag (--structured-outputs-config.backend X)
        takes_value = known.get(name.partition(".")[0] if "." in name else name)
        if name in MODEL_FLAGS or (name.startswith("-") and takes_value is None):
            dropped.append(name)
            # a value follows unless it is another flag (or inline)
            value_follows = not has_inline and i + 1 < len(args)
            i += 2 if value_follows and not str(args[i + 1]).startswith("--") else 1
            continue
        kept.append(arg)
        if takes_value and not has_inline and i + 1 < len(args):
            # nargs="+" options (--served-model-name, --lora-modules) take values up to the next flag
            i += 1
            while i < len(args) and not str(args[i]).startswith("--"):
                kept.append(str(args[i]))
                i += 1
            continue
        i += 1
    return kept, dropped


def _generation_cap(args: list[str]) -> list[str]:
    """The runner's cap on a request's new tokens (PIPELINE_SERVE_MAX_NEW_TOKENS), as vLLM's
    --override-generation-config max_new_tokens, unless the test sets a generation config: the
    tests that set no max_tokens would otherwise write up to the whole context on 2 cores."""
    cap = os.environ.get("PIPELINE_SERVE_MAX_NEW_TOKENS")
    if not cap or {"--generation-config", "--override-generation-config"} & set(args):
        return []
    return ["--override-generation-config", json.dumps({"max_new_tokens": int(cap)})]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RemoteOpenAIServer:
    """vLLM's test server, as pipeline-serve: the test's model name is served by the default
    model, its flags are passed on where this server has them."""

    DUMMY_API_KEY = "token-abc123"
    show_hidden_metrics = False  # vLLM's --show-hidden-metrics-for-version: none here

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str],
        *,
        env_dict: dict[str, str] | None = None,
        seed: int | None = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        override_hf_configs: dict[str, Any] | None = None,
    ) -> None:
        args, dropped = map_args(list(vllm_serve_args))
        _report({"kind": "server", "model": model, "dropped": dropped, "kept": args})
        self.host = "127.0.0.1"
        # auto_port=False: the test names the port among its flags (vLLM's RemoteOpenAIServer)
        given_port = args[args.index("--port") + 1] if "--port" in args else None
        self.port = int(given_port) if not auto_port and given_port else _free_port()
        # vLLM's --uds: the server answers on that socket only (url_root names it as vLLM does)
        self.uds = args[args.index("--uds") + 1] if "--uds" in args else None
        names = [] if "--served-model-name" in args else ["--served-model-name", model]
        seed_args = [] if seed is None or "--seed" in args else ["--seed", str(seed)]
        address = [] if self.uds else ["--host", self.host]
        if not self.uds and (auto_port or given_port is None):
            address += ["--port", str(self.port)]
        command = [
            *json.loads(os.environ["PIPELINE_SERVE_CMD"]),
            os.environ["PIPELINE_SERVE_MODEL"],
            *names,
            *address,
            *seed_args,
            *_generation_cap(args),
            *args,
        ]
        env = {**os.environ, **(env_dict or {})}
        # the server imports this project, not the checkout's packages nor this plugin's deps
        env["PYTHONPATH"] = os.environ.get("PIPELINE_SERVE_SOURCE", "")
        # the server's output, read back when it fails to start; closed with the server
        self._log = tempfile.NamedTemporaryFile(prefix="pipeline-serve-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            command, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_until_healthy(max_wait_seconds or SERVER_START_S)
        except BaseException:
            self._stop()
            raise

    def _wait_until_healthy(self, timeout_s: float) -> None:
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.seek(0)
                tail = self._log.read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"pipeline-serve exited {self.proc.returncode}:\n{tail}")
            try:
                if self._health() == 200:
                    return
            except (requests.RequestException, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"pipeline-serve was not healthy within {timeout_s:g} s")

    def _health(self) -> int:
        import requests

        if self.uds is None:
            return int(requests.get(self.url_for("health"), timeout=2).status_code)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(self.uds)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            status_line = sock.recv(64).split(b"\r\n", 1)[0]
        return int(status_line.split()[1])

    @property
    def url_root(self) -> str:
        if self.uds is not None:
            return f"http://{self.uds.split('/')[-1]}"
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def get_async_client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def _stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()


def _skip_mark(*args: Any, **kwargs: Any) -> Any:
    """A GPU or ROCm marker of tests.utils: such tests are skipped here."""
    mark = pytest.mark.skip(reason="needs a GPU")
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return mark(args[0])
    return mark


class _TestsUtils(types.ModuleType):
    """tests.utils as the entrypoint tests use it."""

    RemoteOpenAIServer = RemoteOpenAIServer
    ROCM_EXTRA_ARGS: list[str] = []

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        if attribute in ("VLLM_PATH",):
            return Path.cwd()
        if attribute.endswith(("_only", "_test", "_mark", "_marks")) or attribute.startswith(
            ("requires_", "multi_gpu", "large_gpu")
        ):
            return _skip_mark
        return _Internal(f"tests.utils.{attribute}")


# --- no network: LoRA adapters of the served model ---------------------------------------


# LoRA adapters the tests download whose names do not say so (tests/entrypoints/conftest.py's
# qwen3_lora_files).
_UNNAMED_ADAPTERS = frozenset({"vllm-project/self_cognition_Alice"})


def _is_adapter(repo_id: str) -> bool:
    return "lora" in repo_id.lower() or repo_id in _UNNAMED_ADAPTERS


def _lora_adapter(repo_id: str) -> str:
    """A PEFT LoRA adapter of the served model (rank 8, B zero: the base model's outputs) for
    any adapter repo (_is_adapter); made once per name in a temporary directory."""
    import numpy as np
    from safetensors.numpy import save_file

    shape = json.loads(os.environ["PIPELINE_SERVE_SHAPE"])
    root = Path(tempfile.gettempdir()) / "pipeline-serve-conformance-loras"
    directory = root / repo_id.replace("/", "--")
    if (directory / "adapter_config.json").exists():
        return str(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rank = 8
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_heads"], shape["num_kv_heads"]
    head_dim = shape["head_dim"]
    outputs = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
               "v_proj": kv_heads * head_dim, "o_proj": hidden}  # fmt: skip
    inputs = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": heads * head_dim}
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(shape["num_layers"]):
        for name, out_features in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal(
                (rank, inputs[name]), dtype=np.float32
            )
            tensors[f"{prefix}.lora_B.weight"] = np.zeros((out_features, rank), np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(outputs),
              "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return str(directory)


def _snapshot_download(repo_id: str, *args: Any, **kwargs: Any) -> str:
    if _is_adapter(repo_id):
        return _lora_adapter(repo_id)
    pytest.skip(f"downloads {repo_id} (no network here)")


# --- hooks ----------------------------------------------------------------------------------

sys.meta_path.insert(0, _VllmFinder())
unittest.mock.NonCallableMock._mock_add_spec = _mock_add_spec(  # type: ignore[method-assign]
    unittest.mock.NonCallableMock._mock_add_spec
)


def _served_tokenizer_for_hub_names(from_pretrained: Any) -> Any:
    """transformers' AutoTokenizer.from_pretrained with a hub name (no network here) gives the
    served model's tokenizer, the model that answers under every test's model name."""

    def load(name: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(name, str) and not Path(name).exists() and "gguf_file" not in kwargs:
            return _tokenizer(name)
        return from_pretrained(name, *args, **kwargs)

    return load


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Before the first conftests: a suite rooted below tests/ (tool_use) imports tests.utils
    from its own conftest, which pytest loads before pytest_configure."""
    _install()


def pytest_configure(config: pytest.Config) -> None:
    _install()


def _install() -> None:
    """The stand-ins of tests.utils, the hub's downloads and its tokenizers (once)."""
    if isinstance(sys.modules.get("tests.utils"), _TestsUtils):
        return
    import huggingface_hub
    import transformers

    auto = transformers.AutoTokenizer
    auto.from_pretrained = _served_tokenizer_for_hub_names(auto.from_pretrained)

    import tests  # the checkout's package: this plugin replaces its utils module

    utils = _TestsUtils("tests.utils")
    sys.modules["tests.utils"] = utils
    tests.utils = utils  # type: ignore[attr-defined]
    huggingface_hub.snapshot_download = _snapshot_download


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _in_test
    _in_test = True
    try:
        return (yield)
    finally:
        _in_test = False


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that cannot be imported here: its tests count as one entry, with the reason."""
    if report.outcome == "passed":
        return
    text = report.longreprtext.strip() if report.longreprtext else ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    outcome = "skipped" if report.outcome == "skipped" else "failed"
    reason = text.splitlines()[-1] if text else ""
    if outcome == "failed" and any(words in text for words in _NO_NETWORK):
        outcome, reason = "skipped", "downloads from the hub (no network here)"
    elif outcome == "failed" and "pipeline_serve_vllm._Internal" in text:
        # a module that builds vLLM's own classes (pydantic models over its types) at import
        outcome, reason = "skipped", f"{INTERNAL}: the module builds vLLM's classes at import"
    _report(
        {
            "kind": "test",
            "nodeid": report.nodeid,
            "when": "collect",
            "outcome": outcome,
            "reason": reason[:500],
        }
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        reason = ""
        outcome = report.outcome
        if outcome == "skipped" and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        elif outcome == "failed":
            outcome, reason = _failure(report)
        _report(
            {
                "kind": "test",
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": outcome,
                "reason": reason[:500],
            }
        )


# What a test process (not the server) raises when it needs a file from the Hugging Face hub.
_NO_NETWORK = ("Check your internet connection", "LocalEntryNotFoundError", "offline mode")


def _failure(report: pytest.TestReport) -> tuple[str, str]:
    """(outcome, reason) of a failed phase: the exception's own message (pytest's crash line,
    not the last line of an assertion's explanation), or a skip for what this machine lacks."""
    text = report.longreprtext or ""
    crash = getattr(report.longrepr, "reprcrash", None)
    reason = crash.message if crash is not None else (text.strip().splitlines() or [""])[-1]
    missing = re.search(r"fixture '(\w+)' not found", text)
    if report.when == "setup" and missing:
        # a fixture of vLLM's model-test conftest (media servers, GPU probes)
        return "skipped", f"needs vLLM's fixture: {missing.group(1)}"
    if any(words in text for words in _NO_NETWORK) and "pipeline-serve" not in reason:
        return "skipped", "downloads from the hub (no network here)"
    return "failed", reason
