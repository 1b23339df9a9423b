"""A tiny released VELA in the release's own formats, random weights, converted by the same ``capeval convert vela``
code a user runs: ``vela_regressor.safetensors`` (PEFT-named LoRA factors on the LLM's ``q_proj`` / ``v_proj``, the
aspect embedding, a one-layer head), ``longclip-L.pt`` (a Long-CLIP state dict: OpenAI's CLIP layout with 248 text
positions in two tables) and a Qwen2 causal LM folder standing for Qwen2.5-3B-Instruct.

Which names the released file gives its tensors could not be read from the official code here (see the VELA card):
these are PEFT's names under an ``llm.`` module, the converter reads any prefix.
"""
from __future__ import annotations

import io
from pathlib import Path

from capeval_plugins import files
from capeval_plugins.testing import builder
from capeval_plugins.testing.official import TINY_CLIP, _convert_into, bpe_vocabulary_size, openai_clip_state, write_bpe

LONG_CONTEXT = 248
LORA_RANK = 4
MODE_DIM = 8


def build_qwen2(path: str | Path, seed: int = 0) -> Path:
    """A tiny Qwen2 causal LM (Qwen2.5's architecture: biased q/k/v projections, grouped-query attention, tied
    embeddings) with a byte-level BPE Qwen2Tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from capeval_plugins.testing.vision_language import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def long_clip_state(seed: int, vocab_size: int) -> dict:
    """Long-CLIP's state dict layout: OpenAI's CLIP with ``positional_embedding`` and ``positional_embedding_res``
    of 248 rows each."""
    import torch

    state = openai_clip_state(seed, vocab_size, context=LONG_CONTEXT, **TINY_CLIP)
    gen = torch.Generator().manual_seed(seed + 7)
    state["positional_embedding_res"] = torch.randn(LONG_CONTEXT, TINY_CLIP["width"], generator=gen) * 0.05
    return state


def regressor_state(seed: int, llm_hidden: int, layers: int, kv_width: int) -> dict:
    """``vela_regressor.safetensors``' tensors: LoRA A / B for every layer's q_proj and v_proj (PEFT names), the
    aspect embedding and the head (one Linear, sigmoid in the model)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 3)
    state = {}
    for i in range(layers):
        for proj, width in (("q_proj", llm_hidden), ("v_proj", kv_width)):
            prefix = f"llm.base_model.model.layers.{i}.self_attn.{proj}"
            state[f"{prefix}.lora_A.default.weight"] = torch.randn(LORA_RANK, llm_hidden, generator=gen) * 0.2
            state[f"{prefix}.lora_B.default.weight"] = torch.randn(width, LORA_RANK, generator=gen) * 0.2
    state["mode_embedding.weight"] = torch.randn(3, MODE_DIM, generator=gen)
    size = 2 * llm_hidden + 2 * TINY_CLIP["embed_dim"] + MODE_DIM
    state["regressor.weight"] = torch.randn(1, size, generator=gen) / size ** 0.5
    state["regressor.bias"] = 0.1 * torch.randn(1, generator=gen)
    return state


def released_vela(folder: str | Path, seed: int = 0, bpe: str | Path | None = None) -> dict[str, Path]:
    """The three released pieces in ``folder``: ``qwen/`` (the base LLM), ``longclip-L.pt``,
    ``vela_regressor.safetensors``; returns their paths (and the BPE's)."""
    import torch
    from safetensors.torch import save
    from transformers import AutoConfig

    folder = Path(folder)
    bpe = Path(bpe) if bpe else write_bpe(folder / "bpe.txt.gz")
    qwen = build_qwen2(folder / "qwen", seed)
    config = AutoConfig.from_pretrained(qwen)
    kv = config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    regressor = regressor_state(seed, config.hidden_size, config.num_hidden_layers, kv)
    buffer = io.BytesIO()
    torch.save(long_clip_state(seed, bpe_vocabulary_size(bpe)), buffer)
    with files.Folder.open(folder, create=True)[0] as out:
        out.write("longclip-L.pt", buffer.getvalue())
        out.write("vela_regressor.safetensors", save({k: v.contiguous() for k, v in regressor.items()}))
    return {"qwen": qwen, "long_clip": folder / "longclip-L.pt", "regressor": folder / "vela_regressor.safetensors",
            "bpe": bpe}


@builder("vela")
def build_vela(path: Path, seed: int) -> None:
    from capeval_plugins.commands.convert_vela import convert_vela

    def convert(scratch: Path) -> None:
        parts = released_vela(scratch / "release", seed)
        convert_vela(parts["regressor"], scratch / "out", parts["long_clip"], llm=str(parts["qwen"]),
                     clip_tokenizer=str(parts["bpe"]))

    _convert_into(path, convert)
