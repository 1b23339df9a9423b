"""``capeval convert expert ADAPTER [DST]``: EXPERT's released weights folded into LLaVA-1.5-13B as a transformers
folder the ``expert`` metric loads.

    capeval convert expert EXPERT-llava-13b-lora/            # -> the folder expert loads by default
    capeval convert expert EXPERT-llava-13b-lora/ out/ --base llava-hf/llava-1.5-13b-hf

``ADAPTER`` is the folder of ``hjkim811/EXPERT-llava-13b-lora`` (LLaVA's own LoRA output): ``adapter_config.json``,
``adapter_model.safetensors`` or ``.bin`` (the LoRA factors of the language model's linear layers) and
``non_lora_trainables.bin`` (the trained projector). LLaVA's loader (``load_pretrained_model``) adds the projector
to ``liuhaotian/llava-v1.5-13b`` and merges the LoRA (W + (alpha / r) B A); here the same is done to that model's
transformers conversion (``--base``, default ``llava-hf/llava-1.5-13b-hf``), whose weights are the same, in float32
then rounded once to the base's dtype. Pickles are read with ``torch.load(weights_only=True)`` after their archive
is checked, each member against its CRC-32; every released tensor must be finite, and no matrix or LoRA factor may
be only zeros (a safetensors file has no checksum: one cut short into a pre-allocated file is zeros where it
stopped, and its LoRA would fold in nothing). Every released tensor is accounted for (a LoRA factor pair of a known
layer, or the projector); anything else, a factor without its pair, a shape that does not fit, or an adapter option
LLaVA's merge does not use (DoRA, a bias, per-layer ranks) is refused. Loading a 13B base takes about 26 GB of
memory."""
from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from capeval_plugins import files
from capeval_plugins.commands.convert import (ConversionError, converted_folder, read_checkpoint, run_conversion,
                                              write_report)
from capeval_plugins.commands.convert_official import check_not_zeroed, check_weights, sha256

DEFAULT_BASE = "llava-hf/llava-1.5-13b-hf"
_LORA = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp)\.\w+_proj)\.lora_([AB])(?:\.default)?"
                   r"\.weight$")
_PROJECTOR = re.compile(r"^(?:base_model\.)?(?:model\.)?model\.mm_projector\.([02])\.(weight|bias)$")
_UNSUPPORTED = {"use_dora": True, "fan_in_fan_out": True}


@dataclass
class ExpertConversion:
    source: str
    base: str
    destination: str
    scaling: float
    merged: int = 0
    projector: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        return "\n".join([f"converted {self.source} -> {self.destination} (expert, base {self.base})",
                          f"  LoRA folded into {self.merged} weights (scaling {self.scaling:g})",
                          f"  projector replaced: {len(self.projector)} tensors"])


def adapter_scaling(config: dict[str, Any], where: Path) -> float:
    """alpha / r (alpha / sqrt(r) with rsLoRA), refusing what LLaVA's merge does not apply."""
    for key, bad in _UNSUPPORTED.items():
        if config.get(key) == bad:
            raise ConversionError(f"{where}: {key}={bad} is not supported")
    if config.get("bias", "none") != "none" or config.get("rank_pattern") or config.get("alpha_pattern") \
            or config.get("modules_to_save"):
        raise ConversionError(f"{where}: only a plain LoRA (no bias, no per-layer ranks, no saved modules) is "
                              "supported")
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise ConversionError(f"{where}: no integer r and lora_alpha") from None
    if rank < 1 or not alpha > 0:
        raise ConversionError(f"{where}: r and lora_alpha must be positive")
    return alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank


def read_whole(path: Path) -> dict[str, Any]:
    """A released weights file, refused unless whole: dense finite tensors backed by their bytes
    (:func:`check_weights`) and no matrix or LoRA factor of only zeros (:func:`check_not_zeroed`)."""
    state = read_checkpoint(path)
    check_weights(state, path)
    check_not_zeroed(state, path)
    return state


def read_adapter(folder: Path) -> tuple[float, dict[str, tuple[Any, Any]], dict[str, Any], dict[str, str]]:
    """(scaling, {base weight name: (A, B)}, {base weight name: projector tensor}, {file: SHA-256})."""
    from capeval_plugins.core import jsonio

    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ConversionError(f"{folder}: no adapter_config.json (the folder of {'hjkim811/EXPERT-llava-13b-lora'})")
    scaling = adapter_scaling(jsonio.loads(files.read_input(config_file, "adapter_config.json").decode()), config_file)
    weights = next((folder / n for n in ("adapter_model.safetensors", "adapter_model.bin") if (folder / n).is_file()),
                   None)
    extra = folder / "non_lora_trainables.bin"
    if weights is None or not extra.is_file():
        raise ConversionError(f"{folder}: expected adapter_model.safetensors (or .bin) and non_lora_trainables.bin")
    factors: dict[str, dict[str, Any]] = {}
    for key, tensor in read_whole(weights).items():
        match = _LORA.match(key)
        if match is None:
            raise ConversionError(f"{weights}: {key} is not a LoRA factor of a language-model layer")
        name = f"model.language_model.layers.{match.group(1)}.{match.group(2)}.weight"
        factors.setdefault(name, {})[match.group(3)] = tensor
    unpaired = sorted(n for n, f in factors.items() if set(f) != {"A", "B"})
    if unpaired or not factors:
        what = f"LoRA factors without their pair: {', '.join(unpaired)}" if unpaired else "no LoRA factors"
        raise ConversionError(f"{weights}: {what}")
    projector = {}
    for key, tensor in read_whole(extra).items():
        match = _PROJECTOR.match(key)
        if match is None:
            raise ConversionError(f"{extra}: {key} is not the projector (mm_projector.0 / .2), the only trained "
                                  "weights besides the LoRA that the EXPERT release has")
        projector[f"model.multi_modal_projector.linear_{1 if match.group(1) == '0' else 2}.{match.group(2)}"] = tensor
    digests = {str(p): sha256(p) for p in (config_file, weights, extra)}
    return scaling, {n: (f["A"], f["B"]) for n, f in sorted(factors.items())}, projector, digests


def convert_expert(source: str | Path, destination: str | Path | None = None, base: str = DEFAULT_BASE,
                   overwrite: bool = False, dtype: str = "float16") -> ExpertConversion:
    """Fold the adapter folder ``source`` into ``base`` and save the result (in ``dtype``: the release's float16 by
    default) into ``destination`` (default: the folder the metric loads)."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from capeval_plugins.resources import loading
    from capeval_plugins.models.encoders.openai_clip import converted_model_dir

    source = Path(source)
    if not source.is_dir():
        raise ConversionError(f"{source}: not a folder (the adapter folder hjkim811/EXPERT-llava-13b-lora)")
    scaling, factors, projector, digests = read_adapter(source)
    try:
        model = loading.load_model(LlavaForConditionalGeneration, base, device="cpu", dtype=dtype, share=False)
        processor = loading.load_processor(AutoProcessor, base)
    except (OSError, ValueError) as err:
        raise ConversionError(f"cannot load the base {base}: {' '.join(str(err).split())[:300]}") from None
    params = dict(model.named_parameters())
    problems = [n for n in [*factors, *projector] if n not in params]
    for name, (a, b) in factors.items():
        if name in params and (a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(params[name].shape)
                               or a.shape[0] != b.shape[1]):
            problems.append(f"{name} (LoRA {tuple(b.shape)} x {tuple(a.shape)} for {tuple(params[name].shape)})")
    problems += [f"{n} ({tuple(t.shape)} for {tuple(params[n].shape)})" for n, t in projector.items()
                 if n in params and t.shape != params[n].shape]
    if problems:
        raise ConversionError(f"{source}: does not fit {base}: {', '.join(problems[:5])}")
    with torch.no_grad():
        for name, (a, b) in factors.items():
            weight = params[name]
            weight.copy_((weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype))
        for name, tensor in projector.items():
            params[name].copy_(tensor.to(params[name].dtype))
    destination = Path(destination) if destination else converted_model_dir("expert")
    with converted_folder(destination, overwrite) as staged:
        model.save_pretrained(staged)
        processor.save_pretrained(staged)
        report = ExpertConversion(source=str(source), base=base, destination=str(destination), scaling=scaling,
                                  merged=len(factors), projector=sorted(projector), digests=digests)
        write_report(staged, asdict(report))
    return report


def cmd_expert(args: argparse.Namespace) -> int:
    return run_conversion(lambda: convert_expert(args.source, args.destination, args.base, args.overwrite, args.dtype),
                          args.source, args.json)


def add_parser(subparsers) -> None:
    """Nothing at the top level: the kind is ``capeval convert expert`` (:func:`add_parsers`)."""


def add_parsers(kinds) -> None:
    p = kinds.add_parser("expert", help="EXPERT (hjkim811/EXPERT-llava-13b-lora, a LoRA over LLaVA-1.5-13B)",
                         description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="the adapter folder (adapter_config.json, adapter_model.*, non_lora_trainables.bin)")
    p.add_argument("destination", nargs="?", help="output folder (default: the folder expert loads by default)")
    p.add_argument("--base", default=DEFAULT_BASE,
                   help=f"the transformers LLaVA-1.5-13B to fold it into: a folder or hub id (default {DEFAULT_BASE})")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                   help="the saved weights' dtype (default float16, the release's; the merge is computed in float32)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier conversion's files there")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_expert)
