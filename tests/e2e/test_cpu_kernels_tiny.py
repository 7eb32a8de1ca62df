"""pipeline-serve on CPU never serves on the torch path by surprise: a compiler that fails on
the kernels stops it with the compiler's message and the way out, and the torch path asked for
with PIPELINE_SERVE_NATIVE=0 serves and says so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.serving import ROOT, http_get, running_server
from tests.server.live import free_port
from tests.stages.tiny import build_tiny_chat_model

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def broken_build(tmp_path_factory) -> dict[str, str]:
    """A compiler that answers --version and fails every build, and a cache of its own."""
    root = tmp_path_factory.mktemp("broken")
    cc = root / "cc"
    cc.write_text(
        '#!/bin/sh\ncase "$*" in *--version*) exec gcc "$@";; esac\n'
        'echo "cc: internal error: boom" >&2\nexit 1\n'
    )
    cc.chmod(0o755)
    return {"CC": str(cc), "PIPELINE_SERVE_CACHE": str(root / "cache")}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"))


def test_a_failed_kernel_build_stops_the_server_with_the_way_out(model, broken_build):
    argv = [sys.executable, "-m", "server.cli", str(model), "--port", str(free_port())]
    result = subprocess.run(
        [*argv, "--log-format", "json"],
        cwd=ROOT,
        env={**os.environ, **broken_build},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    lines = (result.stdout + result.stderr).splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    failed = [e for e in events if e["event"] == "the engine failed to start"]
    assert failed, "\n".join(lines[-20:])
    reason = failed[0]["reason"]
    assert "cc: internal error: boom" in reason and "PIPELINE_SERVE_NATIVE=0" in reason
    assert not any(line.startswith("Traceback") for line in lines)  # the reason, not a trace


def test_the_torch_path_asked_for_serves_and_says_so(model, broken_build, tmp_path):
    port = free_port()
    env = {**broken_build, "PIPELINE_SERVE_NATIVE": "0"}
    args = [str(model), "--served-model-name", "tiny", "--kv-cache-memory", "2MiB"]
    with running_server(args, port, tmp_path / "serve.log", env):
        status, version = http_get(port, "/version")
        assert status == 200 and json.loads(version)["kernels"] == "torch"
        _, metrics = http_get(port, "/metrics")
        assert 'vllm:kernels_info{kernels="torch",model_name="tiny"} 1.0' in metrics
