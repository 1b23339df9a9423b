"""Tiny released checkpoints of PAC-S, PAC-S++ and Polos, in the official formats (OpenAI-layout ``.pth`` state
dicts, a Lightning-style ``.ckpt``), random weights, converted by the same ``capeval convert`` code a user runs.

``pacs``, ``pacs_pp`` (LoRA factors of rank 4 on every layer, as PAC-S++'s ``clip_lora``) and ``polos`` use a
small BPE written in OpenAI's ``bpe_simple_vocab_16e6.txt.gz`` format; :func:`released_pacs` and
:func:`released_polos` write the released files themselves (for tests of the converter and for side-by-side runs
of the official code, e.g. with OpenAI's real vocabulary).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from capeval_plugins import files
from capeval_plugins.testing import builder
from capeval_plugins.testing.corpus import caption_corpus, train_bpe

TINY_CLIP = dict(width=64, layers=2, image_size=32, patch_size=8, embed_dim=16)


def write_bpe(path: str | Path, merges: list[tuple[str, str]] | None = None) -> Path:
    """A BPE merges file in OpenAI's format (a header line, one merge per line, gzip), from a BPE trained on the
    synthetic caption corpus unless ``merges`` are given."""
    if merges is None:
        _, merges = train_bpe(caption_corpus(), 400, ["<|startoftext|>", "<|endoftext|>"], end_of_word_suffix="</w>",
                              lowercase=True)
    text = "#version: 0.2 (capeval test vocabulary)\n" + "\n".join(" ".join(m) for m in merges) + "\n"
    path = Path(path)
    with files.Folder.open(path.parent, create=True)[0] as folder:
        folder.write(path.name, gzip.compress(text.encode("utf-8"), mtime=0))
    return path


def bpe_vocabulary_size(path: str | Path) -> int:
    lines = gzip.decompress(Path(path).read_bytes()).decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    return 512 + len([line for line in lines if line.strip()]) + 2


def openai_clip_state(seed: int, vocab_size: int, width: int = 64, layers: int = 2, image_size: int = 32,
                      patch_size: int = 8, embed_dim: int = 16, context: int = 77, lora_rank: int = 0) -> dict:
    """A random state dict in OpenAI's CLIP ViT layout (``clip.model.CLIP``; with ``lora_rank``, the parameter
    names of PAC-S++'s ``clip_lora`` model, every LoRA factor non-zero)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    grid = image_size // patch_size
    state = {"visual.class_embedding": rand(width), "visual.positional_embedding": rand(grid * grid + 1, width),
             "visual.conv1.weight": rand(width, 3, patch_size, patch_size), "visual.proj": rand(width, embed_dim),
             "token_embedding.weight": rand(vocab_size, width), "positional_embedding": rand(context, width),
             "text_projection": rand(width, embed_dim), "logit_scale": torch.tensor(4.6052)}
    for norm in ("visual.ln_pre", "visual.ln_post", "ln_final"):
        state[f"{norm}.weight"], state[f"{norm}.bias"] = 1 + rand(width), rand(width)
    for tower in ("visual.transformer", "transformer"):
        for i in range(layers):
            p = f"{tower}.resblocks.{i}."
            state.update({p + "attn.in_proj_weight": rand(3 * width, width), p + "attn.in_proj_bias": rand(3 * width),
                          p + "attn.out_proj.weight": rand(width, width), p + "attn.out_proj.bias": rand(width),
                          p + "mlp.c_fc.weight": rand(4 * width, width), p + "mlp.c_fc.bias": rand(4 * width),
                          p + "mlp.c_proj.weight": rand(width, 4 * width), p + "mlp.c_proj.bias": rand(width)})
            for norm in ("ln_1", "ln_2"):
                state[p + f"{norm}.weight"], state[p + f"{norm}.bias"] = 1 + rand(width), rand(width)
            if lora_rank:
                r = lora_rank
                state.update({p + "attn.in_proj_weight_lora_A": rand(r, width), p + "attn.in_proj_weight_lora_B": rand(3 * width, r),
                              p + "attn.out_proj.lora_A": rand(r, width), p + "attn.out_proj.lora_B": rand(width, r),
                              p + "mlp.c_fc.lora_A": rand(r, width), p + "mlp.c_fc.lora_B": rand(4 * width, r),
                              p + "mlp.c_proj.lora_A": rand(r, 4 * width), p + "mlp.c_proj.lora_B": rand(width, r)})
    if lora_rank:
        k = patch_size
        state["visual.conv1.lora_A"] = rand(lora_rank * k, 3 * k)
        state["visual.conv1.lora_B"] = rand(width * k, lora_rank * k)
    return state


def released_pacs(path: str | Path, seed: int = 0, bpe: str | Path | None = None, lora_rank: int = 0,
                  **shape: int) -> Path:
    """A PAC-S (``lora_rank=0``) or PAC-S++ checkpoint file as released (``{"state_dict": ...}``, ``torch.save``)."""
    import io

    import torch

    vocab = bpe_vocabulary_size(bpe) if bpe else 49408
    state = openai_clip_state(seed, vocab, lora_rank=lora_rank, **{**TINY_CLIP, **shape})
    buffer = io.BytesIO()
    torch.save({"state_dict": state}, buffer)
    path = Path(path)
    with files.Folder.open(path.parent, create=True)[0] as folder:
        folder.write(path.name, buffer.getvalue())
    return path


def polos_state(seed: int, text_folder: str | Path, clip_vocab: int, hidden_sizes=(24, 12)) -> dict:
    """A Polos ``PolosEstimator`` state dict: the text encoder's weights from a RoBERTa folder (``encoder.model.*``),
    a random OpenAI-layout CLIP (``clip.*``), the scalar mix and the regressor (``scalar_mix.*``, ``ff.0.ff.*``)."""
    import torch
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed + 1)
    text = load_file(str(Path(text_folder) / "model.safetensors"))
    config = json.loads((Path(text_folder) / "config.json").read_text())
    state = {f"encoder.model.{k}": v for k, v in text.items()}
    state.update({f"clip.{k}": v for k, v in openai_clip_state(seed, clip_vocab, **TINY_CLIP).items()})
    for i in range(config["num_hidden_layers"] + 1):
        state[f"scalar_mix.scalar_parameters.{i}"] = torch.randn(1, generator=gen)
    state["scalar_mix.gamma"] = 1 + 0.1 * torch.randn(1, generator=gen)
    layers = config["num_hidden_layers"] + 1
    state["scalar_mix.dropout_mask"], state["scalar_mix.dropout_fill"] = torch.zeros(layers), torch.full((layers,), -1e20)
    sizes = [4 * config["hidden_size"] + 6 * TINY_CLIP["embed_dim"], *hidden_sizes, 1]
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:]), 1):
        state[f"ff.0.ff.linear_{i}.weight"] = torch.randn(n_out, n_in, generator=gen) / n_in ** 0.5
        state[f"ff.0.ff.linear_{i}.bias"] = 0.1 * torch.randn(n_out, generator=gen)
    return state


POLOS_HPARAMS = ("model: PolosEstimator\nencoder_model: BERT\npretrained_model: princeton-nlp/sup-simcse-roberta-base\n"
                 "layer: mix\npool: cls\nactivations: Tanh\nhidden_sizes: '24,12'\nfinal_activation: false\n"
                 "scalar_mix_dropout: 0.1\ndropout: 0.1\n")


def released_polos(folder: str | Path, text_folder: str | Path, bpe: str | Path, seed: int = 0) -> Path:
    """``folder/reprod.ckpt`` (a Lightning-style checkpoint whose ``hyper_parameters`` name a Lightning class) and
    ``folder/hparams.yaml`` as the released ``reprod.zip`` lays them out."""
    import argparse
    import io

    import torch

    state = polos_state(seed, text_folder, bpe_vocabulary_size(bpe))
    buffer = io.BytesIO()
    torch.save({"state_dict": state, "epoch": 3, "hyper_parameters": argparse.Namespace(pool="cls", layer="mix")},
               buffer)
    with files.Folder.open(folder, create=True)[0] as out:
        out.write("reprod.ckpt", buffer.getvalue())
        out.write("hparams.yaml", POLOS_HPARAMS.encode())
    return Path(folder) / "reprod.ckpt"


def _convert_into(path: Path, convert) -> None:
    """Run a converter into a private folder and move its files into ``path``."""
    scratch = files.private_folder("capeval-official-")
    try:
        convert(scratch)
        for item in Path(scratch, "out").iterdir():
            if not item.name.startswith(".capeval"):  # the converter's ownership marker stays behind
                item.rename(path / item.name)
    finally:
        files.remove_private(scratch)


@builder("pacs")
def build_pacs(path: Path, seed: int) -> None:
    from capeval_plugins.commands.convert_official import convert_pacs

    def convert(scratch: Path) -> None:
        bpe = write_bpe(scratch / "bpe.txt.gz")
        convert_pacs(released_pacs(scratch / "clip_ViT-B-32.pth", seed, bpe), scratch / "out", "vit-b-32", str(bpe))

    _convert_into(path, convert)


@builder("pacs_pp")
def build_pacs_pp(path: Path, seed: int) -> None:
    from capeval_plugins.commands.convert_official import convert_pacs

    def convert(scratch: Path) -> None:
        bpe = write_bpe(scratch / "bpe.txt.gz")
        convert_pacs(released_pacs(scratch / "PAC++.pth", seed, bpe, lora_rank=4), scratch / "out", "vit-l-14",
                     str(bpe))

    _convert_into(path, convert)


@builder("polos")
def build_polos(path: Path, seed: int) -> None:
    from capeval_plugins.commands.convert_official import convert_polos
    from capeval_plugins.testing.text_encoders import build_simcse_roberta

    def convert(scratch: Path) -> None:
        roberta = scratch / "roberta"
        build_simcse_roberta(roberta, seed)
        bpe = write_bpe(scratch / "bpe.txt.gz")
        convert_polos(released_polos(scratch / "reprod", roberta, bpe, seed), scratch / "out",
                      text_tokenizer=str(roberta), clip_tokenizer=str(bpe))

    _convert_into(path, convert)
