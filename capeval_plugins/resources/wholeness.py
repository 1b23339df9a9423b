"""Whole models only: a checkpoint is checked against what its architecture declares before it scores, and
every loader's own failure becomes one line.

A model folder is checked at three moments, cheapest first; the first fault refuses it in one line
(:class:`ModelLoadError`, exit code 2 on the command line) naming the file and the tensor or size at fault:

1. **before anything is built** (:func:`config_problem`): the sizes ``config.json`` declares against the weights'
   own safetensors headers (:func:`read_weights`, which reads headers only). A layer or expert count may not
   exceed the highest index in the tensor names, and a width (``vocab_size``, ``hidden_size``,
   ``intermediate_size``) may not exceed every dimension the weights hold: a KB-sized configuration asking for
   100,000 layers or a 20,000,000-token vocabulary is refused in milliseconds, not after minutes or gigabytes.
2. **on an empty build** (:func:`empty_model` on the ``meta`` device, which allocates nothing;
   :func:`declared_problem`): each tensor the architecture declares that the weights hold by name must have the
   shape they hold, and the architecture may not declare more values than the files hold, so nothing the loader
   later allocates exceeds what is on disk.
3. **after loading** (:func:`loaded_problem`, :func:`nonfinite_problem`, :func:`zeroed_problem`): transformers'
   own loading report, with its renamings and tied weights: nothing missing (but what the caller initialises on
   purpose: ``allow_missing``, said in the metric's card), nothing of another shape, nothing foreign inside the
   model's own modules (a whole head the model does not have, a checkpoint's ``lm_head`` or ``pooler``, is left
   out as transformers leaves it), every floating-point value finite, no weight matrix all zeros.

Weights files of the package's own making (a trained head, a projector) are checked name by name
(:func:`tensors_problem`). Tokenizers are checked whole too (:func:`tokenizer_problem`: a BPE vocabulary must
come with the merges that build it); processors and tokenizers against the model beside them in
:mod:`capeval_plugins.resources.agreement`.

:func:`loader_boundary` is the one place a loader's failure becomes that line: whatever a third-party loader
raises on a damaged file (a JSON error in a tokenizer file, a safetensors error, a KeyError in a converter, a
RecursionError on deep nesting), besides a missing optional dependency (ImportError) and running out of memory.
"""
from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from capeval_plugins.core.messages import ModelLoadError  # noqa: F401  (raised here; importable from here)


def first_line(err: BaseException) -> str:
    """The first line of an error's message (with the next one when it only announces them: torch's "Error(s)
    in loading state_dict for X:"), with its type unless it is an OSError (whose text says enough)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2] if lines and lines[0].endswith(":") else lines[:1])[:400]
    if isinstance(err, OSError) and text:
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _out_of_memory(err: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(err, (MemoryError, oom))


@contextmanager
def loader_boundary(kind: str, source: Any, passing: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run a loader; anything it raises becomes :class:`ModelLoadError` ``cannot load KIND 'SOURCE': ...`` (one
    line), except a :class:`ModelLoadError` already worded, a missing optional dependency (ImportError: the
    environment's, said as it is), running out of memory (not the file's fault) and the caller's own worded
    errors (``passing``)."""
    try:
        yield
    except (ModelLoadError, ImportError, *passing):
        raise
    except BaseException as err:
        # a Rust library's panic (tokenizers given merges of tokens it lacks) is a BaseException, not an Exception
        if _out_of_memory(err) or not (isinstance(err, Exception) or type(err).__name__ == "PanicException"):
            raise
        raise ModelLoadError(f"cannot load {kind} {str(source)!r}: {first_line(err)}") from err


# --- the weights' own headers ----------------------------------------------------------------------------------

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
DIFFUSERS_FILE = "diffusion_pytorch_model.safetensors"  # a diffusers model's weights (SD3's transformer, VAE)


@dataclass(frozen=True)
class Weights:
    """The tensors a folder's safetensors weights declare: name -> shape, and the file holding each."""

    shapes: Mapping[str, tuple[int, ...]]
    owner: Mapping[str, str]
    files: tuple[str, ...] = (WEIGHTS_FILE,)
    dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        first = self.files[0] if self.files else WEIGHTS_FILE
        return first if len(self.files) <= 1 else f"{first} (and {len(self.files) - 1} more shards)"

    def where(self, name: str) -> str:
        return self.owner.get(name, self.label)

    def values(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values())

    def widest(self) -> int:
        """The largest dimension of any tensor holding data (0 when none does)."""
        return max((max(shape) for shape in self.shapes.values() if shape and math.prod(shape)), default=0)

    def deepest(self) -> int:
        """The largest integer in any tensor name's dotted parts (layers.11 -> 11), -1 when none has one."""
        return max((int(part) for name in self.shapes for part in name.split(".") if part.isascii() and part.isdigit() and len(part) < 9),
                   default=-1)


def read_weights(folder: str | os.PathLike, name: str = WEIGHTS_FILE) -> Weights | None:
    """The tensors of a model folder's weights, read from the safetensors headers alone: ``name`` (transformers'
    ``model.safetensors``, which it loads first; diffusers' :data:`DIFFUSERS_FILE`), else the shards its
    ``.index.json`` names. None when the folder has neither (the loader then says what it found). Raises
    :class:`ModelLoadError` for a damaged header, an index naming a file outside the folder, or a tensor declared
    by two shards."""
    from capeval_plugins.resources import tensorfile

    folder = os.fspath(folder)
    single = os.path.join(folder, name)
    index = os.path.join(folder, f"{name}.index.json")
    if os.path.isfile(single):
        files = [name]
    elif os.path.isfile(index):
        files = _shards(index)
    else:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    for name in files:
        try:
            header = tensorfile.check_file(os.path.join(folder, name))
        except tensorfile.TensorFileError as err:
            raise ModelLoadError(str(err)) from None
        for tensor, (dtype, shape) in header.items():
            if tensor in owner:
                raise ModelLoadError(f"{os.path.join(folder, name)}: tensor {tensor!r} is also in {owner[tensor]}")
            shapes[tensor], owner[tensor], dtypes[tensor] = tuple(shape), name, dtype
    return Weights(shapes, owner, tuple(files), dtypes)


def _read_json(path: str) -> Any:
    from capeval_plugins.core import jsonio

    with open(path, "rb") as f:
        return jsonio.loads(f.read())


def _shards(index: str) -> list[str]:
    try:
        weight_map = _read_json(index).get("weight_map")
    except (ValueError, AttributeError) as err:
        raise ModelLoadError(f"{index} is not a weights index ({first_line(err)})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(f"{index} has no weight_map of tensor names to shard files")
    shards = sorted(set(weight_map.values()))
    bad = [s for s in shards if os.path.basename(s) != s or s in (".", "..") or not s.endswith(".safetensors")]
    if bad:
        raise ModelLoadError(f"{index} names {bad[0]!r}, not a safetensors file beside it")
    return shards


# --- 1. sizes in config.json against the headers, before anything is built ------------------------------------

# Counts of modules that get one entry each in the tensor names (layers.0 ... layers.N-1): num_hidden_layers,
# v_num_hidden_layers, n_layer, encoder_layers, depth, ... (not thresholds such as Qwen2's max_window_layers).
LAYER_COUNT = re.compile(r"^([a-z]_)?(num|n)_(\w+_)?layers?$|^(encoder|decoder)_layers$|^depth$|^num_blocks$")
EXPERT_COUNT = re.compile(r"^(num|n|moe_num)_(\w+_)?experts$")
WIDTHS = ("vocab_size", "hidden_size", "intermediate_size")
# A width at most this large is left to the empty build (2.): unused sub-configurations keep their defaults.
WIDTH_FLOOR = 2**16


def _sizes(config: Mapping[str, Any], path: str = "", depth: int = 0,
           kinds: tuple[type, ...] = (int,)) -> Iterator[tuple[str, str, Any]]:
    """(dotted path, key, value) of every integer (or every value of ``kinds``) in a configuration and its nested
    configurations."""
    if depth > 8:
        return
    for key, value in config.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, kinds):
            yield f"{path}{key}", str(key), value
        elif isinstance(value, Mapping):
            yield from _sizes(value, f"{path}{key}.", depth + 1, kinds)


# Normalisation epsilons (layer_norm_eps, rms_norm_eps, layer_norm_epsilon, ...) are small positive numbers (real
# ones 1e-12 to 1e-5); 0 or a negative one divides by zero or takes the root of a negative number in every norm,
# and the features come out NaN, which a metric can only report as invalid rows (exit 0, every score null).
EPSILON = re.compile(r"(^|_)(eps|epsilon)$")
POSITIVE = ("rope_theta",)  # a rotary base of 0 or less makes every angle NaN or infinite


def settings_problem(config: Mapping[str, Any]) -> str | None:
    """Why a setting of ``config`` that no weight holds makes every output non-finite, or None."""
    for where, key, value in _sizes(config, kinds=(int, float)):
        if EPSILON.search(key) and not 0 < value < 1:
            return (f"config.json declares {where} = {value}, but a normalisation epsilon is a small positive number "
                    "(real ones 1e-12 to 1e-5): every output would be NaN")
        if key in POSITIVE and not (value > 0 and math.isfinite(value)):
            return f"config.json declares {where} = {value}, but it must be a positive number: every output would be NaN"
    return None


def config_problem(config: Mapping[str, Any], weights: Weights) -> str | None:
    """Why the sizes of ``config`` (config.json as read) cannot describe ``weights``, or None: checked on names
    and numbers alone, before anything is built."""
    if not weights.shapes:
        return f"{weights.label} holds no tensors at all"
    deepest, widest = weights.deepest(), weights.widest()
    for where, key, value in _sizes(config):
        if LAYER_COUNT.search(key) and value > deepest + 1:
            held = f"modules numbered 0 to {deepest} at most" if deepest >= 0 else "no numbered modules (layers)"
            return (f"config.json declares {where} = {value}, but the weights in {weights.label} hold {held}: the "
                    "configuration and the weights are not of one model")
        if EXPERT_COUNT.search(key) and value > max(deepest + 1, widest):
            return f"config.json declares {where} = {value}, more than the weights in {weights.label} hold"
        if key in WIDTHS and value > max(widest, WIDTH_FLOOR):
            return (f"config.json declares {where} = {value}, larger than every dimension of the weights in "
                    f"{weights.label} (at most {widest}): the configuration and the weights are not of one model")
    return None


# --- 2. the architecture built empty, against the headers ------------------------------------------------------

def empty_model(loader: Any, source: str, hub: Mapping[str, Any], kwargs: Mapping[str, Any]) -> Any:
    """The model ``loader.from_pretrained(source, **kwargs)`` would build, built on the ``meta`` device from its
    configuration alone (nothing allocated, no weights read); None for a loader that is neither a transformers
    model class nor an auto class (a plugin's own: checked after loading only)."""
    from transformers import AutoConfig, PreTrainedModel

    concrete = isinstance(loader, type) and issubclass(loader, PreTrainedModel)
    if not concrete and not callable(getattr(loader, "from_config", None)):
        return None
    config_loader = getattr(loader, "config_class", None) if concrete else None
    config, model_kwargs = (config_loader or AutoConfig).from_pretrained(source, return_unused_kwargs=True,
                                                                         **hub, **kwargs)
    with torch.device("meta"):
        if concrete:
            return loader(config, **model_kwargs)
        return loader.from_config(config, trust_remote_code=bool(hub.get("trust_remote_code")), **model_kwargs)


def _allowed(name: str, allow_missing: Sequence[str]) -> bool:
    return any(re.search(pattern, name) for pattern in allow_missing)


def _aligned(model: Any, declared: Mapping[str, Any], weights: Weights) -> dict[str, str]:
    """Declared name -> name in the weights, with the model's base prefix added or dropped as transformers does
    (a head model from a base checkpoint, a base model from a head checkpoint); names that match none are left
    out."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    readings = [lambda n: n]
    if prefix:
        readings += [lambda n: n[len(prefix) + 1:] if n.startswith(prefix + ".") else n, lambda n: f"{prefix}.{n}"]
    hits = [sum(read(n) in weights.shapes for n in declared) for read in readings]
    read = readings[hits.index(max(hits))]
    return {n: read(n) for n in declared if read(n) in weights.shapes}


def declared_problem(model: Any, weights: Weights, allow_missing: Sequence[str] = (), quantized: bool = False) -> str | None:
    """Why the empty ``model`` (:func:`empty_model`) is not what ``weights`` hold, or None: a tensor of another
    shape under the same name, or more values declared than the files hold (tied weights counted once; what the
    caller initialises on purpose left out; not counted for a quantized checkpoint, whose files pack values)."""
    state = model.state_dict(keep_vars=True)
    declared = {n: tuple(t.shape) for n, t in state.items()}
    aligned = _aligned(model, declared, weights)
    for name, stored in aligned.items():
        if weights.shapes[stored] != declared[name]:
            return (f"{weights.where(stored)} holds {stored} of shape {list(weights.shapes[stored])}, but the "
                    f"configuration (config.json) declares {list(declared[name])}")
        stored_float = weights.dtypes.get(stored, "F")[0] in "FB" and weights.dtypes.get(stored) != "BOOL"
        if not quantized and state[name].is_floating_point() != stored_float:  # the bits would be read as numbers of another kind
            return (f"{weights.where(stored)} holds {stored} as {weights.dtypes[stored]}, but the architecture "
                    f"declares a {'floating-point' if state[name].is_floating_point() else 'integer'} tensor")
    if quantized:
        return None
    wanted = sum(p.numel() for n, p in model.named_parameters() if not _allowed(n, allow_missing))
    buffers = dict(model.named_buffers())
    wanted += sum(b.numel() for n, b in buffers.items() if n in declared and not _allowed(n, allow_missing))
    scratch = sum(b.numel() for n, b in buffers.items() if n not in declared)
    held = weights.values()
    if wanted > held or scratch > held + 2**20:
        absent = [n for n in declared if n not in aligned and not _allowed(n, allow_missing)]
        hint = f" ({absent[0]} is not in it)" if absent else ""
        return (f"the configuration (config.json) declares {max(wanted, scratch):,} values but {weights.label} holds "
                f"{held:,}{hint}: an interrupted download, or the configuration and the weights are not of one model")
    return None


# --- 3. after loading --------------------------------------------------------------------------------------------

def _inside(model: Any, name: str) -> bool:
    """Whether checkpoint name ``name`` falls inside one of ``model``'s own modules, parameters or buffers
    (rather than in a whole head the model does not have)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    own = {n for part in (model.named_children(), model.named_parameters(recurse=False),
                          model.named_buffers(recurse=False)) for n, _ in part}
    top = name.split(".", 1)[0]
    if top == prefix and prefix not in own and "." in name:
        top = name.split(".", 2)[1]
    return top in own


def _listed(names: Sequence[str], label: str) -> str:
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f"{names[0]}{more} {label}"


def loaded_problem(model: Any, info: Mapping[str, Any], weights_label: str, allow_missing: Sequence[str] = ()) -> str | None:
    """Why a model loaded with ``output_loading_info`` is not whole, or None."""
    missing = sorted(k for k in info.get("missing_keys") or () if not _allowed(k, allow_missing))
    if missing:
        return (f"{weights_label} lacks {_listed(missing, 'that the architecture in config.json declares')}: an "
                "interrupted download, or another model's weights? copy the model folder again")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        name, stored, wanted = mismatched[0]
        return (f"{weights_label} holds {name} of shape {list(stored)}, but the configuration (config.json) "
                f"declares {list(wanted)}")
    foreign = sorted(k for k in info.get("unexpected_keys") or () if _inside(model, k))
    if foreign:
        return f"{weights_label} holds {_listed(foreign, 'that the architecture in config.json does not declare')}"
    errors = info.get("error_msgs") or []
    if errors:
        return f"{weights_label}: {' '.join(str(errors[0]).split())[:300]}"
    return None


FINITE_CHUNK = 1 << 24  # elements checked at a time: the check's scratch stays small beside a large embedding


def finite(tensor: torch.Tensor) -> bool:
    if not tensor.is_floating_point() or tensor.device.type == "meta":
        return True
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(FINITE_CHUNK))


def detach_from_files(model: Any) -> Any:
    """``model`` with every parameter and buffer on the CPU copied into the process's own memory. Loaders map
    safetensors files (transformers, diffusers): the tensors are the file's pages, so a file rewritten in place
    after the load (a training run saving over its checkpoint, a copy in progress) changed a model already
    checked and in use, and a file cut shorter killed the process (SIGBUS). Called before the checks below, so
    the values checked are the values scored. Tied weights stay tied (one Parameter, copied once)."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.device.type == "cpu":
                tensor.data = tensor.data.clone()
    return model


def values_problem(model: Any, label: str) -> str | None:
    """The values of a loaded model, copied out of its mapped files first (:func:`detach_from_files`): a
    non-finite value or a weight matrix of only zeros, as a problem, or None."""
    detach_from_files(model)
    return nonfinite_problem(model, label) or zeroed_problem(model, label)


def nonfinite_problem(model: Any, label: str) -> str | None:
    """The first parameter or buffer of ``model`` holding NaN or an infinity, as a problem, or None."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if not finite(tensor):
            return f"{label}: {name} holds NaN or infinite values (a damaged file?)"
    return None


def zeroed_problem(model: Any, label: str) -> str | None:
    """The first weight matrix of ``model`` holding only zeros, as a problem, or None. No trained matrix is all
    zeros, but a download cut short into a file allocated whole beforehand (aria2, hfd.sh) is zeros from where
    it stopped: with a valid header and the right size, it scored every caption 0 without a word. Vectors, of
    any number of dimensions, may be zeros in a whole checkpoint (a bias; DINOv2's mask token, which its
    released teacher never trained) and are not looked at."""
    for name, tensor in model.named_parameters():
        if zeroed(name, tensor):
            return zeroed_message(label, name)
    return None


def zero_matrix(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a floating-point matrix (at least two dimensions larger than 1) of only zeros:
    :func:`zeroed_problem`'s rule, also applied to released weights files before a conversion folds them in."""
    return (sum(size > 1 for size in tensor.shape) >= 2 and tensor.is_floating_point()
            and tensor.device.type != "meta" and not bool(tensor.detach().any()))


def zeroed(name: str, tensor: torch.Tensor) -> bool:
    """:func:`zero_matrix`, or a LoRA factor (``lora_`` in its name) of only zeros whatever its shape: a LoRA of
    zeros adds nothing, so the model would silently be its base. The one rule for loaders, trained weights files
    and converters."""
    if zero_matrix(tensor):
        return True
    return ("lora_" in name and tensor.is_floating_point() and tensor.device.type != "meta"
            and not bool(tensor.detach().any()))


def zeroed_message(label: str, name: str) -> str:
    lora = " (a LoRA factor of zeros adds nothing)" if "lora_" in name else ""
    return (f"{label}: {name} holds only zeros{lora}, as a download cut short into a pre-allocated file does; "
            "copy the model folder again")


def tensors_problem(found: Mapping[str, Any], wanted: Mapping[str, tuple[int, ...]], label: str) -> str | None:
    """Why a weights file of the package's own making (``found``: name -> tensor, or -> shape from its header)
    is not exactly the ``wanted`` names and shapes with finite values and no matrix or LoRA factor of only zeros
    (:func:`zeroed`), or None."""
    def shape(value: Any) -> tuple[int, ...]:
        return tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value)

    missing = sorted(set(wanted) - set(found))
    if missing:
        return f"{label} lacks {_listed(missing, 'of the tensors it must hold')}"
    extra = sorted(set(found) - set(wanted))
    if extra:
        return f"{label} holds {_listed(extra, 'that it should not hold')}"
    for name in sorted(wanted):
        if shape(found[name]) != tuple(wanted[name]):
            return f"{label} holds {name} of shape {list(shape(found[name]))}, not {list(wanted[name])}"
        if isinstance(found[name], torch.Tensor) and not finite(found[name]):
            return f"{label}: {name} holds NaN or infinite values (a damaged file?)"
        if isinstance(found[name], torch.Tensor) and zeroed(name, found[name]):
            return zeroed_message(label, name)
    return None


def module_problem(module: Any, weights: Weights) -> str | None:
    """Why ``module`` (a pipeline's part, loaded by another library) does not hold exactly the tensors of its
    folder's ``weights``, or None: each persistent tensor it declares must be in the files (a tensor tied to one
    that is, sharing its storage, counts as present) with the shape they hold, and nothing foreign may sit inside
    its modules."""
    state = module.state_dict(keep_vars=True)
    storage: dict[Any, list[str]] = {}
    for name, tensor in state.items():
        if tensor.device.type != "meta":
            storage.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)),
                               []).append(name)
    tied = {n: names for names in storage.values() for n in names}
    missing = sorted(n for n in state if not any(m in weights.shapes for m in tied.get(n, [n])))
    if missing:
        return f"{weights.label} lacks {_listed(missing, 'that the architecture in config.json declares')}"
    for name, tensor in state.items():
        if name in weights.shapes and weights.shapes[name] != tuple(tensor.shape):
            return (f"{weights.where(name)} holds {name} of shape {list(weights.shapes[name])}, but the "
                    f"configuration declares {list(tensor.shape)}")
    foreign = sorted(n for n in weights.shapes if n not in state and _inside(module, n))
    if foreign:
        return f"{weights.label} holds {_listed(foreign, 'that the architecture in config.json does not declare')}"
    return None


# --- tokenizers ---------------------------------------------------------------------------------------------------

BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def tokenizer_problem(data: Any) -> str | None:
    """Why a tokenizer's serialisation (tokenizer.json, parsed) is not a whole tokenizer, or None: a model of a
    known type with a non-empty vocabulary, and for BPE the merges that build it: every vocabulary token of
    more than one symbol (beside added tokens and byte-fallback pieces) must be the result of a merge. Real BPE
    vocabularies are built by their merges exactly (Llama 2, Mistral, Qwen, CLIP, RoBERTa: none unbuilt); one
    whose merges are empty or cut splits every word into characters and still scores, wrongly."""
    model = data.get("model") if isinstance(data, Mapping) else None
    if not isinstance(model, Mapping):
        return "it has no tokenizer model"
    kind, vocab = model.get("type"), model.get("vocab")
    if kind is None and "merges" in model:
        kind = "BPE"
    if not vocab:
        return f"its {kind or 'tokenizer'} model has an empty vocabulary"
    if kind != "BPE":
        return None
    if not isinstance(vocab, Mapping):
        return "its BPE vocabulary is not a token -> id table"
    made = set()
    for merge in model.get("merges") or []:
        pair = merge.split(" ", 1) if isinstance(merge, str) else merge
        if isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(p, str) for p in pair):
            made.add(pair[0] + pair[1])
    added = {t.get("content") for t in data.get("added_tokens") or [] if isinstance(t, Mapping)}
    prefix, suffix = model.get("continuing_subword_prefix") or "", model.get("end_of_word_suffix") or ""
    longer = unbuilt = 0
    example = None
    for token in vocab:
        if token in added or BYTE_FALLBACK.fullmatch(token):
            continue
        core = token[: -len(suffix)] if suffix and token.endswith(suffix) else token
        core = core[len(prefix):] if prefix and core.startswith(prefix) else core
        if len(core) < 2:
            continue
        longer += 1
        if token not in made:
            unbuilt += 1
            example = example or token
    if unbuilt > max(16, longer // 10):
        return (f"its BPE merges ({len(model.get('merges') or [])}) do not build {unbuilt} of the {longer} "
                f"multi-symbol tokens of its vocabulary (e.g. {example!r}): its merges are missing or cut")
    return None


def read_tokenizer_json(path: str | os.PathLike) -> Any:
    """A tokenizer.json parsed (its size is bounded by the folder check before any loader reads it)."""
    return _read_json(os.fspath(path))



def check_before_build(loader: Any, source: str, folder: str, hub: Mapping[str, Any], kwargs: Mapping[str, Any],
                       allow_missing: Sequence[str] = ()) -> str:
    """Moments 1 and 2 for a local transformers model folder: its ``config.json`` against its weights' headers
    (:func:`check_config`), then its empty build against them. Returns the weights' label for the report after
    loading; raises :class:`ModelLoadError` naming the fault."""
    config, weights = check_config(source, folder)
    if weights is None:
        return WEIGHTS_FILE  # no safetensors weights: the loader's own error says so
    empty = empty_model(loader, source, hub, kwargs)
    problem = empty is not None and declared_problem(empty, weights, allow_missing,
                                                     quantized="quantization_config" in config)
    if problem:
        raise ModelLoadError(f"cannot load model {source!r}: {problem}")
    return weights.label


def check_config(source: str, folder: str) -> tuple[Mapping[str, Any], Weights | None]:
    """Moment 1 for a local transformers model folder: its config.json read and its sizes checked against the
    weights' headers (:func:`config_problem`), nothing built. Returns both; raises :class:`ModelLoadError`."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"cannot load model {source!r}: {folder} has no config.json (a model folder holds its "
                             "configuration beside its weights); copy the model folder again")
    config = _read_json(config_path)
    if not isinstance(config, Mapping):
        raise ModelLoadError(f"cannot load model {source!r}: {config_path} is not a JSON object")
    weights = read_weights(folder)
    if weights is None and os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        raise ModelLoadError(f"cannot load model {source!r}: {folder} holds pickled weights (pytorch_model.bin) only; "
                             "capeval loads safetensors weights only (a pickle can run code when read)")
    problem = settings_problem(config) or (config_problem(config, weights) if weights is not None else None)
    if problem:
        raise ModelLoadError(f"cannot load model {source!r}: {problem}")
    return config, weights


def pipeline_parts(folder: str) -> dict[str, Weights]:
    """A diffusers pipeline folder's parts (sub-folder -> the headers of its weights), each part's config.json
    checked against them first (:func:`config_problem`); raises :class:`ModelLoadError` naming the part."""
    parts = {}
    for part in sorted(os.listdir(folder)):
        where = os.path.join(folder, part)
        if part.startswith(".") or not os.path.isdir(where):
            continue
        weights = read_weights(where) or read_weights(where, name=DIFFUSERS_FILE)
        if weights is None:
            continue
        config_path = os.path.join(where, "config.json")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        problem = (settings_problem(config) or config_problem(config, weights) if isinstance(config, Mapping)
                   else "config.json is not an object")
        if problem:
            raise ModelLoadError(f"cannot load {part}/ of {folder!r}: {problem}")
        parts[part] = weights
    return parts


def pipeline_problem(pipeline: Any, parts: Mapping[str, Weights], folder: str | None = None) -> str | None:
    """Why a loaded pipeline's parts are not exactly their folders' weights (:func:`module_problem`), or a part
    ``model_index.json`` names has no folder (diffusers then leaves it None, or builds a default in its place: SD3
    without its T5 tokenizer's folder generated with a tokenizer of 104 tokens), or None: checked before the pipeline
    moves to its device (a missing tensor is still on ``meta`` there)."""
    index_file = os.path.join(folder, "model_index.json") if folder else ""
    index = _read_json(index_file) if index_file and os.path.isfile(index_file) else None
    for name, spec in (index.items() if isinstance(index, Mapping) else ()):
        named = isinstance(spec, list) and len(spec) == 2 and all(isinstance(v, str) for v in spec)
        if named and not name.startswith("_") and (getattr(pipeline, name, None) is None
                                                   or not os.path.isdir(os.path.join(folder, name))):
            return f"{name}/ is missing, though model_index.json names it ({spec[1]}): copy the model folder again"
    for part, weights in parts.items():
        module = getattr(pipeline, part, None)
        if isinstance(module, torch.nn.Module):
            problem = module_problem(module, weights)
            if problem:
                return problem if problem.startswith(f"{part}/") else f"{part}/{problem}"
    return None


def pipeline_values_problem(pipeline: Any, parts: Mapping[str, Weights]) -> str | None:
    """:func:`values_problem` of each of a pipeline's parts, on the device it scores on, or None."""
    for part, weights in parts.items():
        module = getattr(pipeline, part, None)
        if isinstance(module, torch.nn.Module):
            problem = values_problem(module, f"{part}/{weights.label}")
            if problem:
                return problem
    return None
