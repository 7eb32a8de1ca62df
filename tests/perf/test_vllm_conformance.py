"""The conformance runner's own logic (perf/vllm_conformance.py and its pytest plugin): how a
test's phases become one outcome, the set-aside list, and the vllm.* stand-ins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from perf.vllm_conformance import PLUGIN_DIR, classify, set_aside


def _record(nodeid: str, outcome: str, reason: str = "") -> dict[str, str]:
    return {"kind": "test", "nodeid": nodeid, "outcome": outcome, "reason": reason}


def test_a_test_is_its_worst_phase_and_a_set_aside_failure_is_the_models():
    aside = [
        {"test": "tests/a.py::test_model_*", "reason": "SmolLM2 knows no capitals"},
        {"test": "tests/a.py::test_inner", "kind": "internal", "reason": "vLLM's own class"},
    ]
    records = [
        _record("tests/a.py::test_ok", "passed"),
        _record("tests/a.py::test_api", "passed"),
        _record("tests/a.py::test_api", "failed", "AssertionError"),  # teardown failed
        _record("tests/a.py::test_model_paris", "failed", "AssertionError"),
        _record("tests/a.py::test_skip", "skipped", "vLLM internals"),
        _record("tests/a.py::test_inner", "failed", "TypeError"),
        {"kind": "collect", "nodeid": "tests/a.py", "outcome": "passed", "reason": ""},
    ]
    outcomes = {o.nodeid: (o.outcome, o.reason) for o in classify(records, aside)}
    assert outcomes == {
        "tests/a.py::test_ok": ("passed", ""),
        "tests/a.py::test_api": ("failed-server", "AssertionError"),
        "tests/a.py::test_model_paris": ("failed-model", "SmolLM2 knows no capitals"),
        "tests/a.py::test_skip": ("skipped", "vLLM internals"),
        "tests/a.py::test_inner": ("skipped", "vLLM's own class"),
    }


def test_every_set_aside_entry_names_tests_and_says_why():
    entries = set_aside()
    assert entries
    for entry in entries:
        assert entry["test"].startswith("tests/") and "::" in entry["test"]
        assert len(entry["reason"]) > 20


def test_a_vllm_error_class_is_a_real_exception_and_the_rest_stand_in():
    # pytest.raises(VLLMValidationError) and `class E(VLLMError)` need types; every other vllm.*
    # name is a stand-in that skips the test using it.
    code = """
import pytest
import pipeline_serve_vllm
from vllm.exceptions import VLLMValidationError
import vllm.exceptions
assert issubclass(VLLMValidationError, Exception)
assert vllm.exceptions.VLLMValidationError is VLLMValidationError
with pytest.raises(VLLMValidationError):
    raise VLLMValidationError("x")
from vllm.entrypoints.openai import serving_chat
assert not isinstance(serving_chat.OpenAIServingChat, type)
error = VLLMValidationError("invalid token ids", parameter="tokens")  # vLLM's keywords
assert str(error) == "invalid token ids"
from unittest.mock import MagicMock
pipeline_serve_vllm._in_test = True
try:
    MagicMock(spec=serving_chat.OpenAIServingChat)
except BaseException as skipped:  # a mock of a vLLM class skips the test
    assert "mocks" in str(skipped)
else:
    raise AssertionError("no skip")
import vllm.envs as envs
for use in (
    lambda: envs.VLLM_MAX_N_SEQUENCES + 1,  # a constant of vLLM's in a test's arithmetic
    lambda: serving_chat.OpenAIServingChat.__new__(serving_chat.OpenAIServingChat),
):
    try:
        use()
    except BaseException as skipped:
        assert "vLLM internals" in str(skipped), skipped
    else:
        raise AssertionError("no skip")
"""
    env_path = str(PLUGIN_DIR)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
