"""SmolLM2 served with --tensor-parallel-size 2 (float32, unquantized, gloo on CPU) writes the
greedy text one execute process writes."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.serving import running_server
from tests.server.live import free_port

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Count to five."]


def greedy_texts(model: str, tp: int, tmp_path) -> list[str]:  # type: ignore[no-untyped-def]
    port = free_port()
    args = ["serve", "--model", model, "--dtype", "float32", "--quantization", "none"]
    args += ["--tensor-parallel-size", str(tp), "--threads", "2"]
    with running_server(args, port, tmp_path / f"tp{tp}.log"):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        return [
            client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": prompt}],
                temperature=0.0,
                max_tokens=32,
            )
            .choices[0]
            .message.content
            or ""
            for prompt in PROMPTS
        ]


@pytest.mark.slow
def test_smollm2_two_ranks_write_the_greedy_text_of_one(smollm2_gguf, tmp_path):
    one = greedy_texts(smollm2_gguf, 1, tmp_path)
    two = greedy_texts(smollm2_gguf, 2, tmp_path)
    assert all(len(text) > 20 for text in one)
    assert two == one
