"""``capeval convert pacs|polos SRC [DST]``: the released PAC-S / PAC-S++ and Polos checkpoints as safetensors folders.

    capeval convert pacs clip_ViT-B-32.pth                 # -> the folder pacscore loads by default
    capeval convert pacs PAC++_clip_ViT-L-14.pth           # -> pacscore_pp's default (LoRA folded in)
    capeval convert polos reprod/reprod.ckpt               # -> polos's default

The released files are PyTorch pickles (``.pth`` state dicts; Polos a PyTorch Lightning ``.ckpt``). They are read
with ``torch.load(weights_only=True)``, which rebuilds tensors, containers and numbers only. A Lightning
checkpoint also names Lightning classes (callback types as keys, hyper-parameter dicts): each of those, and only
those (``pytorch_lightning.*``, ``lightning.*``, ``lightning_fabric.*``, ``argparse.Namespace``), is rebuilt as an
inert stand-in that never runs code; any other global (``os.system``, ``builtins.eval``, ...) refuses the file.

Before ``torch.load`` reads anything, the archive is checked (:func:`capeval_plugins.commands.convert.check_archive`,
shared by every converter): ``torch.save`` stores its members uncompressed under plain relative names, so a
compressed member (a small file inflating to gigabytes), a name with ``..`` or a leading ``/``, or members
declaring more bytes than the file holds refuse the file; then each member must match its CRC-32 (a download cut
short into a pre-allocated file holds zeros where its data stopped). After it,
every weight must be a dense CPU tensor of a float or integer type, finite, and no larger than the bytes behind
it: a stride-0 view of one number declaring a 50,000 x 50,000 matrix costs 10 GB when copied, and is refused
first (torch checks each storage against its record, offsets and strides against their storage).

Every parameter is accounted for (kept, folded in, left out on purpose, metadata; anything else is an error) and
the report is written beside the weights (``conversion.json``, with the source's SHA-256). Without ``DST`` the
folder is the one the metric loads by default (:func:`converted_model_dir`).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import pickle
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from capeval_plugins import files
from capeval_plugins.commands.convert import (ConversionError, check_archive, converted_folder, run_conversion,
                                              write_report)
from capeval_plugins.commands.polos_hparams import polos_hyperparameters

if TYPE_CHECKING:
    from capeval_plugins.models.encoders.openai_clip import ClipMapping

DEFAULT_CLIP_TOKENIZER = "openai/clip-vit-base-patch32"
DEFAULT_TEXT_TOKENIZER = "princeton-nlp/sup-simcse-roberta-base"
STAND_IN_MODULES = ("pytorch_lightning.", "lightning.", "lightning_fabric.")
STAND_IN_NAMES = ("argparse.Namespace",)
# PAC-S backbones: (variant, backbone) -> (family, released file name)
PACS_BACKBONES = {
    ("pacs", "vit-b-32"): ("openai", "clip_ViT-B-32.pth"),
    ("pacs", "open_clip-vit-l-14"): ("open_clip", "openClip_ViT-L-14.pth"),
    ("pacs_pp", "vit-b-32"): ("openai", "PAC++_clip_ViT-B-32.pth"),
    ("pacs_pp", "vit-l-14"): ("openai", "PAC++_clip_ViT-L-14.pth"),
}


@dataclass
class OfficialConversion:
    source: str
    sha256: str
    destination: str
    kind: str
    variant: str = ""
    backbone: str = ""
    kept: int = 0
    lora_folded: list[str] = field(default_factory=list)
    lora_left_out: list[str] = field(default_factory=list)
    left_out: dict[str, list[str]] = field(default_factory=dict)
    stand_ins: list[str] = field(default_factory=list)
    tokenizers: dict[str, str] = field(default_factory=dict)
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    hyperparameters_from: str = ""

    def summary(self) -> str:
        lines = [f"converted {self.source} -> {self.destination} ({self.kind}"
                 + (f", {self.variant} {self.backbone})" if self.variant else ")"), f"  kept {self.kept} tensors"]
        if self.lora_folded:
            lines.append(f"  LoRA folded into {len(self.lora_folded)} weights")
        if self.lora_left_out:
            lines.append(f"  LoRA factors of {len(self.lora_left_out)} MLP weights not applied (as the official "
                         "scoring; --mlp-lora merge applies them)")
        for reason, names in self.left_out.items():
            lines.append(f"  left out on purpose, {reason}: {len(names)}")
        if self.stand_ins:
            lines.append("  Lightning metadata read as inert stand-ins: " + ", ".join(self.stand_ins))
        lines += [f"  {what} tokenizer: {source}" for what, source in self.tokenizers.items()]
        if self.hyperparameters_from:
            from capeval_plugins.commands.polos_hparams import describe

            lines.append(f"  hyper-parameters read: {describe(self.hyperparameters)} (from {self.hyperparameters_from})")
        return "\n".join(lines)


# --- reading a released pickle safely -------------------------------------------------------------------------------

class _Inert(dict):
    """What a Lightning class in a checkpoint becomes: a dict that records what it was given and does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state


def read_released(path: str | os.PathLike) -> tuple[Any, list[str]]:
    """The object pickled in ``path`` and the Lightning globals read as inert stand-ins. Only
    ``torch.load(weights_only=True)`` ever reads it; a global outside the stand-in list refuses the file."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    check_archive(path)
    try:
        return _load(path, []), []
    except pickle.UnpicklingError:
        pass  # a global outside torch's list: which ones, read from the pickle's opcodes without running it
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as err:  # noqa: BLE001  (a damaged archive, or torch's pre-1.6 format)
        raise ConversionError(f"{path}: refused: not a PyTorch checkpoint whose globals can be listed "
                              f"({_first_line(err)})") from None
    refused = [n for n in names if not (n.startswith(STAND_IN_MODULES) or n in STAND_IN_NAMES)]
    if refused:
        raise ConversionError(
            f"{path}: refused: it names {', '.join(refused)}, which could run code; it is only read with "
            "torch.load(weights_only=True), never unpickled freely")
    stand_ins = [(type(n.rsplit(".", 1)[-1], (_Inert,), {}), n) for n in names]
    try:
        return _load(path, stand_ins), list(names)
    except pickle.UnpicklingError as err:
        raise ConversionError(f"{path}: refused ({_first_line(err)})") from None


def _load(path: Path, stand_ins: list) -> Any:
    """``torch.load(weights_only=True)``; anything but an unlisted global (``pickle.UnpicklingError``) is the file's
    fault and one line: torch's rebuild functions given odd arguments raise TypeError, AttributeError, ..."""
    import torch

    try:
        with torch.serialization.safe_globals(stand_ins):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise
    except Exception as err:  # noqa: BLE001  (a hostile or damaged file: never a traceback)
        raise ConversionError(f"{path}: not a PyTorch checkpoint ({_first_line(err)})") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:300]}" if text else type(err).__name__


def released_state_dict(path: str | os.PathLike) -> tuple[dict, Any, list[str]]:
    """(state dict, the whole checkpoint, stand-ins) of a released file: its ``state_dict`` entry when it has
    one, else the file itself; every entry must be a named tensor."""
    import torch

    loaded, stand_ins = read_released(path)
    state = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else loaded
    if not isinstance(state, Mapping) or not state:
        raise ConversionError(f"{path}: expected a state dict (parameter name -> tensor), got {type(state).__name__}")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ConversionError(f"{path}: {len(bad)} entries are not named tensors, e.g. {bad[:3]}")
    check_weights(state, Path(path))
    return {k.removeprefix("module."): v for k, v in state.items()}, loaded, stand_ins


def check_weights(state: Mapping[str, Any], path: Path) -> None:
    """Every weight a dense CPU tensor of a float or integer type, finite, and backed by its own bytes: an
    overlapping view (a stride of 0) may not declare more elements than its storage holds, and the distinct
    views together no more bytes than the file (tied weights, one view under two names, count once)."""
    import torch

    # float8 and other exotic floats are refused: no released checkpoint has them, torch's finiteness check fails
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    seen, total = set(), 0
    for name, t in state.items():
        if (t.layout != torch.strided or t.is_quantized or t.device.type != "cpu" or t.is_complex() or t.dtype == torch.bool
                or (t.is_floating_point() and t.dtype not in floats)):
            raise ConversionError(f"{path}: refused: {name} is a {t.layout} {t.dtype} tensor on {t.device}; only "
                                  "dense CPU tensors of float16, bfloat16, float32, float64 or integers are read")
        if 0 in t.shape and t.dim() > 1:
            raise ConversionError(f"{path}: refused: {name} has a zero-size dimension {list(t.shape)} (no released "
                                  "model has one: a damaged file?)")
        size = t.numel() * t.element_size()
        if size > t.untyped_storage().nbytes() - t.storage_offset() * t.element_size():
            raise ConversionError(f"{path}: refused: {name} declares {tuple(t.shape)} ({size} bytes) over "
                                  f"{t.untyped_storage().nbytes()} stored bytes (an overlapping view)")
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view not in seen:
            seen.add(view)
            total += size
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ConversionError(f"{path}: refused: {name} holds NaN or infinite values (a damaged file?)")
    if total > path.stat().st_size:
        raise ConversionError(f"{path}: refused: its weights declare {total} bytes, more than the file's "
                              f"{path.stat().st_size} (views overlapping one storage)")


def check_not_zeroed(state: Mapping[str, Any], path: Path) -> None:
    """Refuse weights holding a matrix of only zeros (:func:`wholeness.zero_matrix`, the loaders' rule) or a LoRA
    factor of only zeros, whatever its shape. A safetensors file carries no checksum, and one cut short into a
    file allocated whole beforehand (aria2) is zeros where its data stopped: a LoRA of zeros folds in nothing,
    and the converted model would silently be its base."""
    from capeval_plugins.resources.wholeness import zeroed, zeroed_message

    for name, tensor in state.items():
        if zeroed(name, tensor):
            raise ConversionError(f"refused: {zeroed_message(str(path), name)}")


def sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with files.open_input(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- tokenizers ------------------------------------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2, CLIP)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def clip_tokenizer_from_bpe(path: str | os.PathLike):
    """A transformers ``CLIPTokenizer`` from OpenAI's ``bpe_simple_vocab_16e6.txt.gz`` (as ``clip`` reads it: the
    merges after the header line, 48,894 of them; vocabulary = the 256 byte characters, the same with ``</w>``,
    one token per merge, then ``<|startoftext|>`` and ``<|endoftext|>``)."""
    from transformers import CLIPTokenizer

    text = gzip.decompress(files.read_input(path, "BPE vocabulary")).decode("utf-8")
    merges = [tuple(line.split()) for line in text.split("\n")[1:49152 - 256 - 2 + 1] if line.strip()]
    base = list(bytes_to_unicode().values())
    vocab = base + [b + "</w>" for b in base] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges)


CLIP_BPE = "bpe_simple_vocab_16e6.txt.gz"  # OpenAI's CLIP BPE, as the official repositories ship it
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")  # a transformers tokenizer folder holds one of these


def default_tokenizer(checkpoint: str | os.PathLike, kind: str) -> str:
    """The tokenizer beside the released checkpoint when one is there (CLIP: ``bpe_simple_vocab_16e6.txt.gz``;
    the text encoder: a tokenizer folder's files), else the hub id the released run used (read from the Hugging
    Face cache, or the hub)."""
    folder = Path(checkpoint).parent
    if kind == "clip":
        return str(folder / CLIP_BPE) if (folder / CLIP_BPE).is_file() else DEFAULT_CLIP_TOKENIZER
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return str(folder)
    return DEFAULT_TEXT_TOKENIZER


def load_tokenizer(source: str, kind: str):
    """A tokenizer from a folder, a hub id (hub or cache) or, for CLIP, a ``bpe_simple_vocab_16e6.txt.gz`` (or a
    folder holding it)."""
    from transformers import AutoTokenizer, CLIPTokenizer

    from capeval_plugins.resources import loading

    if kind == "clip" and Path(source).is_dir() and (Path(source) / CLIP_BPE).is_file():
        source = str(Path(source) / CLIP_BPE)
    if kind == "clip" and str(source).endswith(".gz"):
        return clip_tokenizer_from_bpe(source)
    try:  # checked whole, as every tokenizer the package loads
        return loading.load_processor(CLIPTokenizer if kind == "clip" else AutoTokenizer, source)
    except (OSError, ValueError) as err:
        hint = (" (the official repositories ship bpe_simple_vocab_16e6.txt.gz: pass its path)" if kind == "clip"
                else " (pass a folder holding its tokenizer files)")
        raise ConversionError(f"cannot load the {kind} tokenizer {source!r} here: {err}{hint}") from None


def check_vocabulary(tokenizer, size: int, what: str) -> None:
    if len(tokenizer) != size:
        raise ConversionError(f"{what}: the tokenizer has {len(tokenizer)} tokens, the model {size}")


# --- writing ----------------------------------------------------------------------------------------------------------

def clip_model(mapping: ClipMapping, tokenizer) -> Any:
    """The transformers CLIP the mapped weights make, checked whole (every parameter, no other) and against the
    tokenizer's vocabulary, before anything is written."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(**mapping.config)
    with torch.device("meta"):
        model = CLIPModel(config)
    try:
        model.load_state_dict({k: v.detach().float().contiguous() for k, v in mapping.state.items()}, strict=True,
                              assign=True)
    except RuntimeError as err:
        raise ConversionError(f"the weights do not fit a CLIP ViT: {' '.join(str(err).split())[:600]}") from None
    check_vocabulary(tokenizer, config.text_config.vocab_size, "CLIP")
    return model


def save_clip(model: Any, folder: Path, mean, std, tokenizer) -> None:
    """A transformers CLIP folder: the weights, an image processor of the official size and normalisation, the
    tokenizer."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    config = model.config
    model.save_pretrained(folder)
    size = config.vision_config.image_size
    image = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                               image_mean=list(mean), image_std=list(std), resample=3)
    CLIPProcessor(image_processor=image, tokenizer=tokenizer).save_pretrained(folder)


def pacs_family(variant: str, backbone: str | None, state: Mapping) -> tuple[str, str]:
    """(backbone, family) of a PAC-S checkpoint: named, or read from the vision width (768: ViT-B/32; 1024:
    PAC-S's open_clip ViT-L/14, PAC-S++'s OpenAI ViT-L/14)."""
    if backbone is None:
        width = state["visual.conv1.weight"].shape[0]
        guess = {768: "vit-b-32", 1024: "open_clip-vit-l-14" if variant == "pacs" else "vit-l-14"}.get(width)
        if guess is None:
            raise ConversionError(f"a vision width of {width} is neither ViT-B/32 nor ViT-L/14: name the "
                                  "architecture with --backbone")
        backbone = guess
    if (variant, backbone) not in PACS_BACKBONES:
        raise ConversionError(f"{variant} has no backbone {backbone!r}: one of "
                              f"{sorted(b for v, b in PACS_BACKBONES if v == variant)}")
    return backbone, PACS_BACKBONES[(variant, backbone)][0]


def convert_pacs(source: str | os.PathLike, destination: str | os.PathLike | None = None, backbone: str | None = None,
                 tokenizer: str | None = None, mlp_lora: str = "ignore",
                 overwrite: bool = False) -> OfficialConversion:
    """Convert a released PAC-S (``clip_ViT-B-32.pth``, ``openClip_ViT-L-14.pth``) or PAC-S++
    (``PAC++_clip_ViT-*.pth``, LoRA) checkpoint into a transformers CLIP folder. ``tokenizer``: CLIP's BPE
    (default: :func:`default_tokenizer`)."""
    tokenizer = tokenizer or default_tokenizer(source, "clip")
    # imported here: building the ``capeval`` parser must not import torch
    from capeval_plugins.models.encoders.openai_clip import (LAION_MEAN, LAION_STD, OPENAI_MEAN, OPENAI_STD,
                                                             converted_model_dir, map_openai_state_dict)

    state, _, stand_ins = released_state_dict(source)
    variant = "pacs_pp" if any("lora_" in k for k in state) else "pacs"
    if "visual.conv1.weight" not in state:
        raise ConversionError(f"{source}: not an OpenAI-layout CLIP ViT state dict (no visual.conv1.weight)")
    backbone, family = pacs_family(variant, backbone, state)
    try:
        mapping = map_openai_state_dict(state, "gelu" if family == "open_clip" else "quick_gelu", mlp_lora)
    except (KeyError, ValueError) as err:
        raise ConversionError(f"{source}: {err}") from None
    if mapping.unknown:
        raise ConversionError(f"{source}: {len(mapping.unknown)} unknown parameter(s): {', '.join(mapping.unknown)}")
    destination = Path(destination) if destination else converted_model_dir(f"{variant}-{backbone}")
    clip_tokenizer = load_tokenizer(tokenizer, "clip")
    model = clip_model(mapping, clip_tokenizer)
    mean, std = (LAION_MEAN, LAION_STD) if family == "open_clip" else (OPENAI_MEAN, OPENAI_STD)
    with converted_folder(destination, overwrite) as staged:
        save_clip(model, staged, mean, std, clip_tokenizer)
        report = OfficialConversion(
            source=str(source), sha256=sha256(source), destination=str(destination), kind="pacs", variant=variant,
            backbone=backbone, kept=len(mapping.state), lora_folded=mapping.lora_merged,
            lora_left_out=mapping.lora_left_out, left_out={"metadata": mapping.metadata} if mapping.metadata else {},
            stand_ins=stand_ins, tokenizers={"CLIP": str(tokenizer)})
        write_report(staged, asdict(report))
    return report


# --- Polos -----------------------------------------------------------------------------------------------------------

POLOS_HEAD = re.compile(r"scalar_mix\.(gamma|dropout_mask|dropout_fill|scalar_parameters\.\d{1,3})"
                        r"|ff\.0\.ff\.linear_\d{1,3}\.(weight|bias)")


def check_polos_head(head: Mapping, layers: int, source: Path) -> list[int]:
    """The regressor's linear layers in order, after checking the head whole: only the released names, one
    scalar-mix parameter of one value per hidden state (``layers`` + 1, numbered from 0), a gamma of one value,
    and each linear layer with a 2-D weight and a bias of its rows, chained input to output."""
    unknown = sorted(k for k in head if not POLOS_HEAD.fullmatch(k))
    if unknown:
        raise ConversionError(f"{source}: not a Polos checkpoint: unknown parameter {unknown[0]}")
    mix = sorted(int(k.rsplit(".", 1)[1]) for k in head if k.startswith("scalar_mix.scalar_parameters."))
    if mix != list(range(layers + 1)):
        raise ConversionError(f"{source}: the scalar mix needs one parameter per hidden state (0 to {layers}), the "
                              f"checkpoint has {mix if len(mix) < 20 else f'{len(mix)}'}")
    for name in [f"scalar_mix.scalar_parameters.{i}" for i in mix] + ["scalar_mix.gamma"]:
        if head[name].numel() != 1:
            raise ConversionError(f"{source}: {name} holds {list(head[name].shape)} values, not one")
    linears = sorted({int(k.split("linear_")[1].split(".")[0]) for k in head if k.startswith("ff.")})
    width = None
    for i in linears:
        weight, bias = head.get(f"ff.0.ff.linear_{i}.weight"), head.get(f"ff.0.ff.linear_{i}.bias")
        if weight is None or bias is None or weight.dim() != 2 or tuple(bias.shape) != (weight.shape[0],):
            raise ConversionError(f"{source}: the regressor's linear_{i} needs a 2-D weight and a bias of its rows, "
                                  f"got {None if weight is None else list(weight.shape)} and "
                                  f"{None if bias is None else list(bias.shape)}")
        if width is not None and weight.shape[1] != width:
            raise ConversionError(f"{source}: the regressor's linear_{i} takes {weight.shape[1]} inputs, the layer "
                                  f"before gives {width}")
        width = weight.shape[0]
    if not linears or width != 1:
        raise ConversionError(f"{source}: the regressor does not end in one output")
    return linears


def polos_config(hp: Mapping, head: Mapping, text: Mapping, text_source: str) -> dict:
    """PolosConfig keyword arguments: the regressor's shape from its weights, the activations from the
    hyper-parameters (released: Tanh between layers, no final activation), the text encoder's configuration from
    ``text_source`` (the checkpoint the run started from, as the official code builds it), else from the shapes
    (RoBERTa's defaults: layer-norm epsilon 1e-5, heads of 64)."""
    from transformers import AutoConfig

    from capeval_plugins.models.encoders.polos import ACTIVATIONS

    if str(hp.get("pool", "cls")) != "cls" or str(hp.get("layer", "mix")) != "mix":
        raise ConversionError(f"only the released Polos configuration (pool=cls, layer=mix) is supported, got "
                              f"pool={hp.get('pool')!r}, layer={hp.get('layer')!r}")
    linears = sorted(int(k.split("linear_")[1].split(".")[0]) for k in head if k.endswith(".weight"))
    hidden = [int(head[f"ff.0.ff.linear_{i}.weight"].shape[0]) for i in linears[:-1]]
    if "hidden_sizes" in hp and [int(h) for h in str(hp["hidden_sizes"]).split(",") if h.strip()] != hidden:
        raise ConversionError(f"the hyper-parameters say hidden_sizes={hp['hidden_sizes']!r} but the regressor's "
                              f"weights have {hidden}")
    final = hp.get("final_activation", False)
    width = text["embeddings.word_embeddings.weight"].shape[1]
    shapes = dict(
        vocab_size=text["embeddings.word_embeddings.weight"].shape[0], hidden_size=width,
        num_hidden_layers=len({k.split(".")[2] for k in text if k.startswith("encoder.layer.")}),
        intermediate_size=text["encoder.layer.0.intermediate.dense.weight"].shape[0],
        max_position_embeddings=text["embeddings.position_embeddings.weight"].shape[0],
        type_vocab_size=text["embeddings.token_type_embeddings.weight"].shape[0])
    try:
        text_config = AutoConfig.from_pretrained(text_source).to_dict()
    except (OSError, ValueError):
        text_config = dict(num_attention_heads=max(width // 64, 1), layer_norm_eps=1e-5, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2)
    wrong = {k: (text_config[k], v) for k, v in shapes.items() if k in text_config and text_config[k] != v}
    if wrong:
        raise ConversionError(f"the text encoder's weights do not match {text_source}'s configuration: {wrong}")
    text_config.update(shapes)
    text_config = {k: v for k, v in text_config.items() if k not in ("architectures", "_name_or_path",
                                                                     "transformers_version", "dtype", "torch_dtype")}
    activation, final = str(hp.get("activations", "Tanh")), final if isinstance(final, str) and final else None
    for name in (activation, final or "Identity"):
        if name not in ACTIVATIONS:
            raise ConversionError(f"the hyper-parameters name the activation {name!r}, not one of {ACTIVATIONS}")
    return dict(encoder_config=text_config, hidden_sizes=hidden, activation=activation, final_activation=final)


def convert_polos(source: str | os.PathLike, destination: str | os.PathLike | None = None,
                  hparams: str | os.PathLike | None = None, text_tokenizer: str | None = None,
                  clip_tokenizer: str | None = None, overwrite: bool = False) -> OfficialConversion:
    """Convert the released Polos checkpoint (``reprod.ckpt``, a Lightning checkpoint of ``PolosEstimator``) into a
    folder: the Polos model (text encoder, scalar mix, regressor) with its RoBERTa tokenizer, and ``clip/``."""
    import torch

    from capeval_plugins.models.encoders.openai_clip import (OPENAI_MEAN, OPENAI_STD, converted_model_dir,
                                                             map_openai_state_dict)
    from capeval_plugins.models.encoders.polos import PolosConfig, PolosModel

    source = Path(source)
    text_tokenizer = text_tokenizer or default_tokenizer(source, "text")
    clip_tokenizer = clip_tokenizer or default_tokenizer(source, "clip")
    state, checkpoint, stand_ins = released_state_dict(source)
    text = {k[len("encoder.model."):]: v for k, v in state.items() if k.startswith("encoder.model.")}
    clip = {k[len("clip."):]: v for k, v in state.items() if k.startswith("clip.")}
    head = {k: v for k, v in state.items() if k.startswith(("scalar_mix.", "ff."))}
    unknown = sorted(set(state) - {f"encoder.model.{k}" for k in text} - {f"clip.{k}" for k in clip} - set(head))
    if not text or not clip or "scalar_mix.gamma" not in head or unknown:
        raise ConversionError(f"{source}: not a Polos checkpoint (encoder.model.*, clip.*, scalar_mix.*, ff.* "
                              f"expected{'; unknown: ' + ', '.join(unknown) if unknown else ''})")
    left_out = {"the text pooler (Polos reads the CLS row of its layer mix)": sorted(k for k in text if k.startswith("pooler.")),
                "buffers": sorted(k for k in text if k.endswith("position_ids"))
                + sorted(k for k in head if k.startswith("scalar_mix.dropout_"))}
    text = {k: v for k, v in text.items() if not k.startswith("pooler.") and not k.endswith("position_ids")}
    layers = len({k.split(".")[2] for k in text if k.startswith("encoder.layer.")})
    check_polos_head(head, layers, source)
    hp, hp_from = polos_hyperparameters(checkpoint, source, hparams)
    try:
        config = PolosConfig(**polos_config(hp, head, text, text_tokenizer))
        mapping = map_openai_state_dict(clip, "quick_gelu")
    except (KeyError, ValueError) as err:
        raise ConversionError(f"{source}: {err}") from None
    if mapping.unknown:
        raise ConversionError(f"{source}: {len(mapping.unknown)} unknown CLIP parameter(s): {', '.join(mapping.unknown)}")
    config.clip_dim = mapping.config["projection_dim"]
    weights = {f"text_encoder.{k}": v for k, v in text.items()}
    n_mix = len([k for k in head if k.startswith("scalar_mix.scalar_parameters.")])
    weights["mix_weights"] = torch.cat([head[f"scalar_mix.scalar_parameters.{i}"].reshape(1) for i in range(n_mix)])
    weights["mix_gamma"] = head["scalar_mix.gamma"].reshape(1)
    linears = sorted(int(k.split("linear_")[1].split(".")[0]) for k in head if k.startswith("ff.0.ff.linear_"))
    for position, i in enumerate(dict.fromkeys(linears)):
        for part in ("weight", "bias"):
            weights[f"regressor.{2 * position}.{part}"] = head[f"ff.0.ff.linear_{i}.{part}"]
    with torch.device("meta"):
        model = PolosModel(config)
    try:
        model.load_state_dict({k: v.detach().float().contiguous() for k, v in weights.items()}, strict=True, assign=True)
    except RuntimeError as err:
        raise ConversionError(f"{source}: the weights do not fit Polos: {' '.join(str(err).split())[:600]}") from None
    roberta = load_tokenizer(text_tokenizer, "text")
    check_vocabulary(roberta, config.encoder_config["vocab_size"], "the text encoder")
    clip_tok = load_tokenizer(clip_tokenizer, "clip")
    clip = clip_model(mapping, clip_tok)  # checked whole before anything is written
    destination = Path(destination) if destination else converted_model_dir("polos")
    with converted_folder(destination, overwrite) as staged:
        model.save_pretrained(staged)
        roberta.save_pretrained(staged)
        save_clip(clip, staged / "clip", OPENAI_MEAN, OPENAI_STD, clip_tok)
        report = OfficialConversion(
            source=str(source), sha256=sha256(source), destination=str(destination), kind="polos",
            kept=len(weights) + len(mapping.state), left_out={k: v for k, v in left_out.items() if v},
            stand_ins=stand_ins, tokenizers={"text": str(text_tokenizer), "CLIP": str(clip_tokenizer)},
            hyperparameters={k: v for k, v in hp.items() if isinstance(v, (str, int, float, bool))},
            hyperparameters_from=hp_from)
        write_report(staged, asdict(report))
    return report


# --- command line ----------------------------------------------------------------------------------------------------

def cmd_pacs(args: argparse.Namespace) -> int:
    return run_conversion(lambda: convert_pacs(args.source, args.destination, args.backbone, args.tokenizer,
                                               args.mlp_lora, args.overwrite), args.source, args.json)


def cmd_polos(args: argparse.Namespace) -> int:
    return run_conversion(lambda: convert_polos(args.source, args.destination, args.hparams, args.text_tokenizer,
                                                args.clip_tokenizer, args.overwrite), args.source, args.json)


def add_parser(subparsers) -> None:
    """Nothing at the top level: this module's kinds are ``capeval convert pacs|polos`` (:func:`add_parsers`, called
    by ``commands/convert.py``); ``commands.add_all`` calls this for every module of the package."""


def _default_destination(name: str) -> str:
    from capeval_plugins.files import paths

    return str(paths.cache_dir("models") / name)


def add_parsers(kinds) -> None:
    p = kinds.add_parser("pacs", help="PAC-S / PAC-S++ (clip_ViT-B-32.pth, openClip_ViT-L-14.pth, PAC++_clip_*.pth)",
                         description="Convert a released PAC-S or PAC-S++ checkpoint (aimagelab/pacscore) into a "
                                     "transformers CLIP folder that pacscore / pacscore_pp load.")
    p.add_argument("source", help="released checkpoint (.pth)")
    p.add_argument("destination", nargs="?",
                   help="output folder (default: the folder the metric loads by default, here "
                        f"{_default_destination('<pacs|pacs_pp>-<backbone>')}, e.g. "
                        f"{_default_destination('pacs-vit-b-32')}; $CAPEVAL_CACHE moves it)")
    p.add_argument("--backbone", choices=sorted({b for _, b in PACS_BACKBONES}),
                   help="the architecture (default: read from the weights)")
    p.add_argument("--tokenizer",
                   help=f"CLIP's BPE: {CLIP_BPE}, a folder holding it, a tokenizer folder or a hub id (default: "
                        f"{CLIP_BPE} beside the checkpoint when it is there, else the hub id {DEFAULT_CLIP_TOKENIZER}, "
                        "which needs the Hugging Face cache or the hub)")
    p.add_argument("--mlp-lora", dest="mlp_lora", choices=("ignore", "merge"), default="ignore",
                   help="PAC-S++: apply the MLP layers' LoRA factors too (the official scoring does not)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier conversion's files there")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_pacs)
    q = kinds.add_parser("polos", help="Polos (reprod.ckpt, a Lightning checkpoint)",
                         description="Convert the released Polos checkpoint (keio-smilab24/Polos) into the folder "
                                     "polos loads.")
    q.add_argument("source", help="released checkpoint (reprod.ckpt)")
    q.add_argument("destination", nargs="?",
                   help=f"output folder (default: the folder polos loads by default, here {_default_destination('polos')}"
                        "; $CAPEVAL_CACHE moves it)")
    q.add_argument("--hparams", help="the run's hparams.yaml (default: the one beside the checkpoint)")
    q.add_argument("--text-tokenizer", dest="text_tokenizer",
                   help="the RoBERTa tokenizer (and its configuration): a folder or a hub id (default: the tokenizer "
                        "files beside the checkpoint when they are there, else the hub id "
                        f"{DEFAULT_TEXT_TOKENIZER}, the run's pretrained_model, which needs the Hugging Face cache or "
                        "the hub)")
    q.add_argument("--clip-tokenizer", dest="clip_tokenizer",
                   help=f"CLIP's BPE: {CLIP_BPE}, a folder holding it, a tokenizer folder or a hub id (default: "
                        f"{CLIP_BPE} beside the checkpoint when it is there, else the hub id {DEFAULT_CLIP_TOKENIZER})")
    q.add_argument("--overwrite", action="store_true", help="replace an earlier conversion's files there")
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.set_defaults(func=cmd_polos)
