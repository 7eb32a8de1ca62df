"""--load-format dummy's engine (vLLM's dummy weights): the model's own config and tokenizer,
its weights made on the device instead of read."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.stages.test_recovery import request


async def outputs_of(engine, req):
    return [out async for out in engine.generate(req)]


def test_random_weights_on_a_models_own_path_serve_its_shape_and_read_no_weight(
    pipeline, tiny_chat_model, tmp_path
):
    """--load-format dummy: the engine takes the model's config and tokenizer and makes its
    weights; the checkpoint's weight file is never opened (here it is not even there)."""
    shape_only = tmp_path / "shape"
    shutil.copytree(tiny_chat_model, shape_only, ignore=shutil.ignore_patterns("*.safetensors"))
    trained, runner_1 = pipeline()
    made, runner = pipeline(model_path=str(shape_only), random_weights=True)
    assert not list(Path(shape_only).glob("*.safetensors"))
    asked = request(2, logprobs=0)
    trained_outs = runner_1.run(outputs_of(trained, asked), 60)
    made_outs = runner.run(outputs_of(made, asked), 60)
    assert sum(len(o.token_ids) for o in made_outs) == 48  # served, to max_tokens

    def logprobs(outs):
        return [lp.logprob for o in outs for lp in o.logprobs or ()]

    assert len(logprobs(made_outs)) == 48
    assert logprobs(made_outs) != logprobs(trained_outs)  # other weights
