"""``capeval convert vela SRC [DST]``: the released VELA checkpoint as one safetensors folder.

    capeval convert vela vela_regressor.safetensors --long-clip longclip-L.pt   # -> the folder vela loads

The release is three files: ``vela_regressor.safetensors`` (Hugging Face ``Ka2ukiMatsuda/vela``: the LLM's LoRA
factors, the aspect embedding and the head), ``longclip-L.pt`` (Hugging Face ``BeichenZhang/LongCLIP-L``, a PyTorch
pickle of Long-CLIP's OpenAI-layout state dict) and the base LLM (``Qwen/Qwen2.5-3B-Instruct``, a hub id or a
folder). The pickle is read as PAC-S's are (``torch.load(weights_only=True)`` after the archive's listing and its
members' CRC-32 are checked; :mod:`capeval_plugins.commands.convert_official`); a safetensors file's header is
checked before it is read, and a matrix or LoRA factor of only zeros refuses it (it has no checksum). The base LLM
is loaded as every model of the package is, checked whole (:func:`capeval_plugins.resources.loading.load_model`).
Every tensor of the release is accounted for (LoRA factors folded into the LLM as ``W + (alpha / r) B A``, the
head's layers chained by their shapes, Long-CLIP's two positional tables joined as its text encoder adds them);
anything else refuses the file, naming it. Where the weights are silent (the head's activation between layers, its
closing squashing, the order of its input, the R2C prompt) the options say, and ``conversion.json`` records it.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

from capeval_plugins import files
from capeval_plugins.commands.convert import ConversionError, converted_folder, run_conversion, write_report
from capeval_plugins.commands.convert_official import (DEFAULT_CLIP_TOKENIZER, OfficialConversion, check_not_zeroed,
                                                       check_weights, clip_model, load_tokenizer, released_state_dict,
                                                       save_clip, sha256)

DEFAULT_LLM = "Qwen/Qwen2.5-3B-Instruct"
LORA_ALPHA = 16.0  # the released configuration: r = 4, lora_alpha = 16 on q_proj and v_proj
LONG_CLIP_KEEP = 20  # Long-CLIP keeps CLIP's first 20 positions (mask1) and adds its stretched table after them

_LORA = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[A-Za-z_]\w*)?\.weight$")
_CLIP = re.compile(r"(?:^|\.)(visual\..+|transformer\.resblocks\..+|token_embedding\.weight|positional_embedding"
                   r"(?:_res)?|ln_final\.(?:weight|bias)|text_projection|logit_scale)$")
_LLM = re.compile(r"(?:^|\.)(embed_tokens\.weight|norm\.weight|layers\.\d+\.(?:self_attn|mlp|input_layernorm|"
                  r"post_attention_layernorm)\..+)$")


def split_release(state: Mapping[str, Any]) -> dict[str, Any]:
    """The released tensors by role: ``lora`` {LLM weight name: {"A", "B"}}, ``llm`` (base weights, if the file has
    them), ``clip`` (Long-CLIP, if it has it), ``mode`` (the aspect embedding), ``head`` {module: {weight, bias}},
    ``left_out`` (an LM head: VELA reads hidden states)."""
    parts: dict[str, Any] = {"lora": {}, "llm": {}, "clip": {}, "mode": None, "head": {}, "left_out": []}
    for name, tensor in state.items():
        if (m := _LORA.search(name)) is not None:
            weight = f"layers.{m.group(1)}.{m.group(2)}.{m.group(3)}.weight"
            parts["lora"].setdefault(weight, {})[m.group(4)] = tensor
        elif (m := _CLIP.search(name)) is not None:
            parts["clip"][m.group(1)] = tensor
        elif (m := _LLM.search(name)) is not None:
            parts["llm"][m.group(1).replace(".base_layer.", ".")] = tensor
        elif name.endswith("lm_head.weight"):
            parts["left_out"].append(name)
        elif "mode" in name.lower() and tensor.dim() == 2:
            if parts["mode"] is not None:
                raise ConversionError(f"two aspect embeddings: {parts['mode'][0]} and {name}")
            parts["mode"] = (name, tensor)
        elif name.endswith((".weight", ".bias")) and tensor.dim() in (1, 2):
            module, kind = name.rsplit(".", 1)
            parts["head"].setdefault(module, {})[kind] = tensor
        else:
            raise ConversionError(f"unknown tensor {name} {tuple(tensor.shape)}: not a LoRA factor, an LLM or "
                                  "Long-CLIP weight, the aspect embedding or a layer of the head")
    for weight, pair in parts["lora"].items():
        if set(pair) != {"A", "B"}:
            raise ConversionError(f"the LoRA factors of {weight} are incomplete (have {sorted(pair)})")
    return parts


def chain_head(head: Mapping[str, Mapping[str, Any]], input_size: int, outputs: int) -> list[str]:
    """The head's Linear layers in order: the one taking ``input_size`` features first, each next one taking the
    previous one's outputs, the last giving ``outputs``; every layer used once."""
    for module, pair in head.items():
        linear = set(pair) == {"weight", "bias"} and pair["weight"].dim() == 2
        if not linear or pair["bias"].shape != pair["weight"].shape[:1]:
            raise ConversionError(f"{module} is not a Linear layer (weight and bias of matching shapes)")
    order, width, left = [], input_size, dict(head)
    while left:
        nxt = [m for m, p in left.items() if p["weight"].shape[1] == width]
        if len(nxt) != 1:
            shapes = {m: tuple(p["weight"].shape) for m, p in head.items()}
            raise ConversionError(f"the head's layers {shapes} do not chain from {input_size} input features "
                                  f"(found {len(nxt)} layers taking {width})")
        order.append(nxt[0])
        width = left.pop(nxt[0])["weight"].shape[0]
    if not order or width != outputs:
        raise ConversionError(f"the head ends with {width} outputs, expected {outputs}")
    return order


def long_clip_state(state: dict[str, Any]) -> dict[str, Any]:
    """Long-CLIP's OpenAI-layout state with its text positions as one table: the first 20 rows of
    ``positional_embedding`` and the rest of ``positional_embedding_res`` (what ``encode_text`` adds through its
    two masks)."""
    import torch

    state = dict(state)
    res = state.pop("positional_embedding_res", None)
    if res is not None:
        base = state["positional_embedding"]
        if res.shape != base.shape:
            raise ConversionError(f"Long-CLIP's positional tables differ in shape: {tuple(base.shape)} and "
                                  f"{tuple(res.shape)}")
        state["positional_embedding"] = torch.cat((base[:LONG_CLIP_KEEP], res[LONG_CLIP_KEEP:]))
    return state


def read_release(path: Path) -> dict[str, Any]:
    """A safetensors file (header checked first) or a PyTorch pickle (read as PAC-S's are), as a state dict, with
    no matrix or LoRA factor of only zeros (:func:`check_not_zeroed`: a safetensors file has no checksum)."""
    from capeval_plugins.resources import tensorfile

    if path.suffix == ".safetensors":
        try:
            state = tensorfile.load_file(path)
        except tensorfile.TensorFileError as err:
            raise ConversionError(str(err)) from None
        check_weights(state, path)
    else:
        state = released_state_dict(path)[0]
    check_not_zeroed(state, path)
    return state


def fold_lora(model, lora: Mapping[str, Mapping[str, Any]], alpha: float) -> list[str]:
    """Add ``(alpha / r) B A`` to each LLM weight that has factors (in float64, rounded once to the weight's
    dtype); returns the weights changed."""
    import torch

    params = dict(model.named_parameters())
    for weight, pair in sorted(lora.items()):
        if weight not in params:
            raise ConversionError(f"LoRA factors for {weight}, which the LLM does not have")
        target, a, b = params[weight], pair["A"].double(), pair["B"].double()
        if a.shape[1] != target.shape[1] or b.shape[0] != target.shape[0] or b.shape[1] != a.shape[0]:
            raise ConversionError(f"the LoRA factors of {weight} {tuple(b.shape)} x {tuple(a.shape)} do not fit "
                                  f"its {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_((target.double() + (b @ a) * (alpha / a.shape[0])).to(target.dtype))
    return sorted(lora)


def load_llm(source: str, base: Mapping[str, Any]):
    """The base LLM (``AutoModel``: its decoder without an LM head) in its configuration's dtype, and its
    tokenizer, from ``source`` (a folder or a hub id), both checked whole by the package's loaders (a weight
    missing would be random in the converted folder, which then loads as whole); the release's own base weights,
    when it has them, replace the loaded ones."""
    from transformers import AutoModel, AutoTokenizer

    from capeval_plugins.resources import loading

    try:
        config = loading.load_config(source)
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        model = loading.load_model(AutoModel, source, device="cpu", dtype=dtype, share=False)
        tokenizer = loading.load_processor(AutoTokenizer, source)
    except (OSError, ValueError) as err:  # a folder's fault is named by the loader; a hub id may not be here
        hint = "" if Path(source).is_dir() else "; pass --llm FOLDER (a local copy of Qwen/Qwen2.5-3B-Instruct)"
        raise ConversionError(f"the LLM: {str(err).splitlines()[0][:400]}{hint}") from None
    if base:
        missing = sorted(set(base) - set(model.state_dict()))
        if missing:
            raise ConversionError(f"the release's LLM weights {missing[:3]} are not {source}'s")
        model.load_state_dict({k: v.to(model.dtype) for k, v in base.items()}, strict=False)
    return model.eval(), tokenizer


def convert_vela(source: str | Path, destination: str | Path | None = None, long_clip: str | Path | None = None,
                 llm: str = DEFAULT_LLM, clip_tokenizer: str = DEFAULT_CLIP_TOKENIZER, lora_alpha: float = LORA_ALPHA,
                 activation: str = "Tanh", output: str = "sigmoid", feature_order: str = "r2c,i2c,mode",
                 prompt: str | Path | None = None, normalize_clip: bool = False,
                 overwrite: bool = False) -> OfficialConversion:
    """Convert the released VELA files into the folder the ``vela`` metric loads."""
    import torch

    from capeval_plugins.models.encoders.openai_clip import (OPENAI_MEAN, OPENAI_STD, converted_model_dir,
                                                           map_openai_state_dict)
    from capeval_plugins.models.encoders.vela import DEFAULT_PROMPT, VelaHead, VelaHeadConfig

    source = Path(source)
    if not source.is_file():
        raise ConversionError(f"{source}: no such file")
    parts = split_release(read_release(source))
    clip_state = parts["clip"]
    if not clip_state:
        if long_clip is None:
            raise ConversionError(f"{source} holds no Long-CLIP weights: pass --long-clip longclip-L.pt")
        clip_state = released_state_dict(long_clip)[0]
    try:
        mapping = map_openai_state_dict(long_clip_state(clip_state), "quick_gelu")
    except (KeyError, ValueError) as err:
        raise ConversionError(f"Long-CLIP: {err}") from None
    if mapping.unknown:
        raise ConversionError(f"Long-CLIP: {len(mapping.unknown)} unknown parameter(s): {', '.join(mapping.unknown)}")
    model, tokenizer = load_llm(llm, parts["llm"])
    folded = fold_lora(model, parts["lora"], lora_alpha)
    mode = parts["mode"][1] if parts["mode"] is not None else None
    text = prompt and files.read_input(prompt, "the R2C prompt").decode("utf-8")
    try:
        config = VelaHeadConfig(llm_hidden=model.config.hidden_size, clip_dim=mapping.config["projection_dim"],
                                mode_embed_dim=0 if mode is None else mode.shape[1], activation=activation,
                                output=output, feature_order=[f.strip() for f in feature_order.split(",")],
                                normalize_clip=normalize_clip, prompt=text or DEFAULT_PROMPT)
        if mode is not None and mode.shape[0] != len(config.aspects):
            raise ValueError(f"the aspect embedding has {mode.shape[0]} rows, not one per aspect {config.aspects}")
        config.check()
    except ValueError as err:
        raise ConversionError(f"{source}: {err}") from None
    order = chain_head(parts["head"], config.input_size, config.outputs)
    config.hidden_sizes = [int(parts["head"][m]["weight"].shape[0]) for m in order[:-1]]
    weights = {f"head.{2 * i}.{kind}": parts["head"][m][kind]
               for i, m in enumerate(order) for kind in ("weight", "bias")}
    if mode is not None:
        weights["mode_embedding.weight"] = mode
    with torch.device("meta"):
        head = VelaHead(config)
    head.load_state_dict({k: v.detach().float().contiguous() for k, v in weights.items()}, strict=True, assign=True)
    clip_tok = load_tokenizer(clip_tokenizer, "clip")
    clip = clip_model(mapping, clip_tok)  # checked whole before anything is written
    destination = Path(destination) if destination else converted_model_dir("vela")
    left_out = {"an LM head (VELA reads hidden states)": parts["left_out"], "metadata": mapping.metadata}
    with converted_folder(destination, overwrite) as staged:
        head.save_pretrained(staged)
        model.save_pretrained(staged / "llm")
        tokenizer.save_pretrained(staged / "llm")
        save_clip(clip, staged / "clip", OPENAI_MEAN, OPENAI_STD, clip_tok)
        report = OfficialConversion(
            source=str(source), sha256=sha256(source), destination=str(destination), kind="vela",
            kept=len(weights) + len(mapping.state) + len(model.state_dict()), lora_folded=folded,
            left_out={k: v for k, v in left_out.items() if v},
            tokenizers={"LLM": str(llm), "CLIP": str(clip_tokenizer)})
        write_report(staged, {**asdict(report), "long_clip": str(long_clip or source), "lora_alpha": lora_alpha,
                              "head": config.to_diff_dict()})
    return report


def cmd_vela(args: argparse.Namespace) -> int:
    return run_conversion(lambda: convert_vela(args.source, args.destination, args.long_clip, args.llm,
                                               args.clip_tokenizer, args.lora_alpha, args.activation, args.output,
                                               args.feature_order, args.prompt, args.normalize_clip, args.overwrite),
                          args.source, args.json)


def add_parser(subparsers) -> None:
    """Nothing at the top level: ``capeval convert vela`` is added by ``commands/convert.py`` (:func:`add_parsers`)."""


# The head's options as models/encoders/vela.py declares them (written out: building the parser imports no torch).
ACTIVATIONS = ("Tanh", "ReLU", "GELU", "Sigmoid", "Identity")
OUTPUTS = ("sigmoid", "clamp")


def add_parsers(kinds) -> None:
    p = kinds.add_parser("vela", help="VELA (vela_regressor.safetensors + longclip-L.pt + Qwen2.5-3B-Instruct)",
                         description="Convert the released VELA checkpoint (Ka2ukiMatsuda/VELA) with Long-CLIP-L and "
                                     "its base LLM into the folder vela loads.")
    p.add_argument("source", help="released checkpoint (vela_regressor.safetensors)")
    p.add_argument("destination", nargs="?", help="output folder (default: the folder vela loads by default)")
    p.add_argument("--long-clip", dest="long_clip", help="longclip-L.pt (unless the checkpoint holds Long-CLIP)")
    p.add_argument("--llm", default=DEFAULT_LLM, help=f"the base LLM: a folder or hub id (default {DEFAULT_LLM})")
    p.add_argument("--clip-tokenizer", dest="clip_tokenizer", default=DEFAULT_CLIP_TOKENIZER,
                   help="CLIP's BPE: a tokenizer folder, a hub id or bpe_simple_vocab_16e6.txt.gz")
    p.add_argument("--lora-alpha", dest="lora_alpha", type=float, default=LORA_ALPHA,
                   help=f"LoRA's alpha (the delta is alpha / r * B A; default {LORA_ALPHA:g}, the released config)")
    p.add_argument("--activation", choices=ACTIVATIONS, default="Tanh", help="between the head's layers, if it has "
                   "several (the weights do not say; default Tanh)")
    p.add_argument("--output", choices=OUTPUTS, default="sigmoid", help="the head's squashing (default sigmoid, "
                   "the paper's; clamp: the raw output clipped to [0, 1])")
    p.add_argument("--feature-order", dest="feature_order", default="r2c,i2c,mode",
                   help="the order of the head's input parts (default r2c,i2c,mode: the paper's, the aspect last)")
    p.add_argument("--prompt", help="a text file with the R2C prompt template ({references}, {candidate})")
    p.add_argument("--normalize-clip", dest="normalize_clip", action="store_true",
                   help="L2-normalise Long-CLIP's embeddings before the head")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier conversion's files there")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_vela)
