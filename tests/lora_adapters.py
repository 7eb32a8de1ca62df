"""Test helper: random PEFT LoRA adapters of a tiny Hugging Face model, saved as PEFT saves them
(adapter_config.json + adapter_model.safetensors), and the PEFT-merged model as the reference."""

from __future__ import annotations

from pathlib import Path


def build_peft_adapter(
    base: Path,
    directory: Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    use_rslora: bool = False,
) -> Path:
    """A LoRA adapter of the model at `base` with random A and B (both nonzero, unlike a fresh
    PEFT adapter's zero B), scaled so that it changes the logits clearly but not wildly."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    adapted = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    adapted.save_pretrained(directory)
    return directory


def merged_logits(base: Path, adapter: Path | None, token_ids: list[int]):  # -> [L, vocab]
    """The logits of the base model with the adapter merged into its weights (PEFT's own
    merge_and_unload), or of the base model alone."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.no_grad():
        return model.eval()(torch.tensor([token_ids])).logits[0].float()
