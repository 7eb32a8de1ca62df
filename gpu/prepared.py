"""A prepared model (weights loaded, dequantized or quantized and repacked) saved once to a file
and mapped back from it: a process that maps it again skips reading and preparing the checkpoint,
and every process that maps it shares the file's pages.
"""

from __future__ import annotations

import torch

from gpu.backends import Kernels
from gpu.fused import FusedLayers
from gpu.model import CausalLM

_FORMAT = 1


def save_prepared(model: CausalLM, path: str) -> None:
    """Write `model` to `path` (torch.save). Its kernel set and native layer structs are left
    out: the set may hold closures, the structs point into this process's memory."""
    fused = model.fused_layers
    kernels = _set_kernels(model, None)
    model.fused_layers = None
    try:
        saved = {
            "format": _FORMAT,
            "model": model,
            "fused_max_rows": None if fused is None else fused.max_rows,
        }
        # The file lives in memory and is never copied: a checksum would only cost seconds.
        crc32 = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(saved, path)
        finally:
            torch.serialization.set_crc32_options(crc32)
    finally:
        _set_kernels(model, kernels)
        model.fused_layers = fused


def load_prepared(path: str, kernels: Kernels, device: str = "cpu") -> CausalLM:
    """The model `save_prepared` wrote, its tensors mapped from the file (copy on write), on
    `kernels`."""
    # weights_only=False: the file holds the module tree; only this server ever writes it.
    saved = torch.load(path, mmap=True, weights_only=False, map_location="cpu")
    if saved.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a prepared model of format {_FORMAT}")
    model: CausalLM = saved["model"]
    _set_kernels(model, kernels)
    model = model.to(device=device)
    if saved["fused_max_rows"] is not None:
        model.fused_layers = FusedLayers.of(model, saved["fused_max_rows"])
    return model


def _set_kernels(model: CausalLM, kernels: Kernels | None) -> Kernels | None:
    """Give every module that runs kernels this set; return the model's previous one."""
    previous = model.kernels
    for module in model.modules():
        if "kernels" in vars(module):
            module.kernels = kernels
    return previous
