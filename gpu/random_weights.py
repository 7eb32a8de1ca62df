"""Random weights made straight on the device, for a model of a given shape that no download
provides (`--random-weights`): what a benchmark of the shape needs, not a trained model."""

from __future__ import annotations

import torch

from gpu.model import CausalLM

# Hugging Face's initializer_range for Llama and Qwen2: activations keep a sane scale through
# the layers, so kernels see realistic magnitudes.
INIT_STD = 0.02


@torch.no_grad()
def fill_random(model: CausalLM, seed: int) -> None:
    """Every parameter in place, on its own device: norms 1, biases 0, the rest N(0, INIT_STD)."""
    generator: torch.Generator | None = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, INIT_STD, generator=generator)
