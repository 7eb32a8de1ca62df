"""--generation-config and --override-generation-config: the sampling defaults a checkpoint
recommends, read as vLLM reads them (get_diff_sampling_param)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.config import generation_defaults

HF_GENERATION_CONFIG = {
    "bos_token_id": 1,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 7,
    "transformers_version": "4.45.0",
}


def _checkpoint(directory: Path, config: dict[str, object]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return str(directory)


def test_auto_reads_the_checkpoints_generation_config(tmp_path):
    model = _checkpoint(tmp_path / "model", HF_GENERATION_CONFIG)
    assert generation_defaults("auto", model) == {
        "repetition_penalty": 1.05,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.9,
        "max_tokens": 7,  # max_new_tokens, under vLLM's name
    }


def test_vllm_ignores_it_and_a_directory_replaces_it(tmp_path):
    model = _checkpoint(tmp_path / "model", HF_GENERATION_CONFIG)
    other = _checkpoint(tmp_path / "other", {"min_p": 0.1, "top_k": 5})
    assert generation_defaults("vllm", model) == {}
    assert generation_defaults(other, model) == {"min_p": 0.1, "top_k": 5}
    assert generation_defaults("auto", str(tmp_path / "empty")) == {}  # no file: no defaults
    with pytest.raises(ValueError, match="not auto, vllm or a directory"):
        generation_defaults(str(tmp_path / "missing"), model)


def test_override_updates_it_even_under_vllm(tmp_path):
    model = _checkpoint(tmp_path / "model", HF_GENERATION_CONFIG)
    override = {"temperature": 0.2, "max_new_tokens": 3, "top_p": None, "do_sample": False}
    defaults = generation_defaults("auto", model, override)
    assert defaults["temperature"] == 0.2 and defaults["max_tokens"] == 3
    assert "top_p" not in defaults
    assert generation_defaults("vllm", model, {"top_k": 4}) == {"top_k": 4}
    with pytest.raises(ValueError, match="temperature must be a number"):
        generation_defaults("vllm", model, {"temperature": "hot"})


def test_a_gguf_offers_its_general_sampling_metadata(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    defaults = generation_defaults("auto", str(path))
    assert defaults == {
        "temperature": pytest.approx(0.7),
        "top_k": 40,
        "repetition_penalty": pytest.approx(1.1),
    }


def test_the_default_model_recommends_nothing(smollm2_gguf):
    assert generation_defaults("auto", smollm2_gguf) == {}
