"""LoRA flags and routes: --lora-modules in both forms, adapters the server cannot apply stop the
start with the reason, VLLM_ALLOW_RUNTIME_LORA_UPDATING, and the load routes refused without it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from quart import Quart

from server.cli import parse_args
from stages.lora import LoraConfig, LoraModule
from tests.lora_adapters import build_peft_adapter
from tests.stages.tiny import build_tiny_chat_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora_cli")
    base = build_tiny_chat_model(root / "base")
    return base, build_peft_adapter(base, root / "adapter", seed=1, rank=8)


def test_lora_flags_and_both_module_forms(tiny) -> None:
    base, adapter = tiny
    json_form = json.dumps({"name": "b", "path": str(adapter), "base_model_name": "tiny"})
    argv = [str(base), "--served-model-name", "tiny", "--enable-lora", "--max-loras", "4"]
    argv += ["--lora-dtype", "bfloat16"]
    argv += ["--max-lora-rank", "8", "--max-cpu-loras", "6", "--lora-modules", f"a={adapter}"]
    config, engine_config = parse_args([*argv, json_form], environ={})
    assert engine_config.lora == LoraConfig(
        max_loras=4, max_lora_rank=8, max_cpu_loras=6, dtype="bfloat16"
    )
    assert config.enable_lora and not config.allow_runtime_lora_updating
    assert config.lora_modules == (
        LoraModule("a", str(adapter)),
        LoraModule("b", str(adapter), "tiny"),
    )
    config, engine_config = parse_args([str(base), "--enable-lora"], environ={})
    assert engine_config.lora == LoraConfig(
        max_loras=1, max_lora_rank=16, max_cpu_loras=None, dtype="auto"
    )
    assert engine_config.lora.cpu_loras == 1  # vLLM's defaults
    assert parse_args([str(base)], environ={})[1].lora is None


@pytest.mark.parametrize("value", ["True", "true", "1"])
def test_runtime_updating_comes_from_vllms_environment_variable(tiny, value) -> None:
    base, _ = tiny
    config, _ = parse_args([str(base)], environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value})
    assert config.allow_runtime_lora_updating
    config, _ = parse_args([str(base)], environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert not config.allow_runtime_lora_updating


def _variant(adapter: Path, directory: Path, **changes: object) -> Path:
    """A copy of the adapter with its adapter_config.json changed."""
    shutil.copytree(adapter, directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(changes)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"use_dora": True}, "does not yet support DoRA"),  # vLLM's words, as below
        ({"modules_to_save": ["lm_head"]}, "Unsupported modules_to_save"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),  # changes the base too
        ({"init_lora_weights": "olora"}, "modify the base model's weights"),
        ({"lora_bias": True}, "lora_bias"),
        ({"use_qalora": True}, "QALoRA"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules ['embed_tokens']"),
        ({"target_modules": ["q_proj"]}, "not in target_modules"),
        ({"bias": "lora_only"}, "biases"),
        ({"r": 4}, "has shape"),
        ({"peft_type": "IA3"}, "not LORA"),
    ],
)
def test_an_adapter_the_server_cannot_apply_stops_the_start(
    tiny, tmp_path, capsys, changes, reason
) -> None:
    base, adapter = tiny
    bad = _variant(adapter, tmp_path / "bad", **changes)
    with pytest.raises(SystemExit) as caught:
        parse_args([str(base), "--enable-lora", "--lora-modules", f"bad={bad}"], environ={})
    assert caught.value.code == 2
    assert reason in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "expected name=path"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "needs 'name' and 'path'"),
        (["--enable-lora", "--max-lora-rank", "12"], "invalid choice"),
        (["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2"], "at least --max-loras"),
        (["--enable-lora", "--lora-modules", "a=/nowhere"], "No adapter found"),
    ],
)
def test_bad_lora_flags_exit(tiny, capsys, argv, reason) -> None:
    base, _ = tiny
    with pytest.raises(SystemExit):
        parse_args([str(base), *argv], environ={})
    assert reason in capsys.readouterr().err


def test_rank_over_max_lora_rank_stops_the_start(tiny, capsys) -> None:
    base, adapter = tiny
    with pytest.raises(SystemExit):
        parse_args(
            [str(base), "--enable-lora", "--max-lora-rank", "1", "--lora-modules", f"a={adapter}"],
            environ={},
        )
    assert "LoRA rank 8 is greater than max_lora_rank 1." in capsys.readouterr().err


@pytest.mark.anyio
async def test_load_routes_exist_only_with_runtime_updating(make_app) -> None:
    body = {"lora_name": "a", "lora_path": "/x"}
    app: Quart = make_app()
    response = await app.test_client().post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 404
    response = await app.test_client().post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert response.status_code == 404
    app = make_app(allow_runtime_lora_updating=True)  # but no --enable-lora
    response = await app.test_client().post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400
    assert "--enable-lora" in (await response.get_json())["error"]["message"]


@pytest.mark.anyio
async def test_load_needs_a_name_and_a_path(make_app) -> None:
    app: Quart = make_app(allow_runtime_lora_updating=True, enable_lora=True)
    response = await app.test_client().post("/v1/load_lora_adapter", json={"lora_name": "a"})
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert error["message"] == "Both 'lora_name' and 'lora_path' must be provided."


def test_lora_knobs_without_enable_lora_and_an_unknown_parent_stop_the_start(tiny, capsys):
    base, adapter = tiny
    for flags in (
        ["--max-loras", "2"],
        ["--max-lora-rank", "8"],
        ["--max-cpu-loras", "2"],
        ["--lora-dtype", "float16"],
    ):
        with pytest.raises(SystemExit):
            parse_args([str(base), *flags], environ={})
        assert f"{flags[0]} needs --enable-lora" in capsys.readouterr().err
    module = json.dumps({"name": "b", "path": str(adapter), "base_model_name": "other"})
    with pytest.raises(SystemExit):
        parse_args(
            [str(base), "--served-model-name", "tiny", "--enable-lora", "--lora-modules", module],
            environ={},
        )
    assert "base_model_name 'other' is not a served model name (tiny)" in capsys.readouterr().err
