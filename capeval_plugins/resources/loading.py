"""Model loading in one place.

Hub id or local path through ``from_pretrained``; ``local_files_only`` honoured; safetensors only;
``trust_remote_code`` off unless asked; device and dtype chosen once (overridable); and one loaded model
shared by every metric instance that asks for the same thing.

A model too large for one device is spread over several, or partly offloaded to CPU memory or disk, with a
``device_map`` (``"auto"``, ``"balanced"``, ``"sequential"`` or an explicit module -> device mapping),
``max_memory`` (a cap per device) and ``offload_folder``: transformers dispatches it with accelerate (an
optional extra). Such a model is never moved with ``.to``; its ``device`` (:func:`input_device`) is where
inputs start and outputs are gathered.
"""
from __future__ import annotations

import importlib.util
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping

import torch


from capeval_plugins.core.messages import MissingExtra, install_extra, warn_once
from capeval_plugins.digests import files_stamp
from capeval_plugins.resources import image_processors, wholeness
from capeval_plugins.resources.accelerate_internals import dispatch_hook, execution_device
# ModelLoadError is defined beside the checks that raise it; callers keep importing it from here
from capeval_plugins.resources.wholeness import ModelLoadError, loader_boundary  # noqa: F401

_cache: dict[Hashable, Any] = {}
_lock = threading.RLock()

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}


ACCELERATE_EXTRA = install_extra("accelerate")


@dataclass(frozen=True)
class ModelSpec:
    """Which checkpoint to load and how: one spec, one shared model (encoders, LVLM judges).

    ``device_map``, ``max_memory`` and ``offload_folder`` place a model over several devices, CPU memory and
    disk (see the module docstring); mappings are kept frozen (sorted key-value tuples) so that a spec stays
    hashable and two spellings of one map are one spec."""

    model: str
    device: str | None = None
    dtype: str | None = None
    revision: str | None = None
    local_files_only: bool | None = None
    trust_remote_code: bool = False
    device_map: Any = None
    max_memory: Any = None
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_map", freeze_device_map(self.device_map))
        object.__setattr__(self, "max_memory", freeze_max_memory(self.max_memory))
        if self.offload_folder is not None:
            object.__setattr__(self, "offload_folder", _folder(self.offload_folder))

    @classmethod
    def from_config(cls, config: Any, model: str | None = None) -> "ModelSpec":
        """From a metric's ``ModelConfig`` (``model`` overrides ``config.model``)."""
        return cls(model or config.model, config.device, config.dtype, config.revision, config.local_files_only,
                   config.trust_remote_code, config.device_map, config.max_memory, config.offload_folder)

    def hub(self) -> dict[str, Any]:
        return {"revision": self.revision, "local_files_only": self.local_files_only,
                "trust_remote_code": self.trust_remote_code}

    def placement(self) -> dict[str, Any]:
        return {"device_map": self.device_map, "max_memory": self.max_memory, "offload_folder": self.offload_folder}


def _device_key(key: Any) -> Any:
    # JSON (the command line) spells GPU indices as strings: {"0": "70GiB"} means GPU 0.
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return key


def freeze_device_map(device_map: Any) -> Any:
    """``None``, a strategy or device name (``"auto"``, ``"cuda:1"``), a GPU index, or a module -> device
    mapping, made hashable (sorted (module, device) pairs; GPU indices given as strings become ints)."""
    if device_map is None or isinstance(device_map, (str, int)):
        return _device_key(device_map) if isinstance(device_map, str) else device_map
    items = device_map.items() if isinstance(device_map, Mapping) else device_map
    try:
        pairs = {str(module): _device_key(str(dev) if not isinstance(dev, int) else dev) for module, dev in items}
    except (TypeError, ValueError):
        raise ValueError(f"device_map must be 'auto', a device or a mapping of module names to devices, got "
                         f"{device_map!r}") from None
    return tuple(sorted(pairs.items()))


def freeze_max_memory(max_memory: Any) -> tuple | None:
    """``None`` or a device -> memory mapping (``{0: "70GiB", "cpu": "200GiB"}``; byte counts or sizes with
    units), made hashable."""
    if max_memory is None:
        return None
    items = max_memory.items() if isinstance(max_memory, Mapping) else max_memory
    try:
        pairs = {_device_key(dev): size for dev, size in items}
    except (TypeError, ValueError):
        raise ValueError(f"max_memory must map devices to sizes, e.g. {{0: '70GiB', 'cpu': '200GiB'}}, got "
                         f"{max_memory!r}") from None
    if not all(isinstance(size, (int, str)) and not isinstance(size, bool) for size in pairs.values()):
        raise ValueError(f"max_memory sizes must be byte counts or strings such as '70GiB', got {max_memory!r}")
    return tuple(sorted(pairs.items(), key=lambda kv: str(kv[0])))


def _folder(path: Any) -> str:
    return os.path.abspath(os.fspath(path) if isinstance(path, os.PathLike) else str(path))


def _thaw(frozen: Any) -> Any:
    return dict(frozen) if isinstance(frozen, tuple) else frozen


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The explicit device, else CUDA when available, else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, gpu_default: torch.dtype = torch.float32
) -> torch.dtype:
    """The explicit dtype, else ``gpu_default`` on accelerators and float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        try:
            return _DTYPES[str(dtype).lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None
    return gpu_default if device.type != "cpu" else torch.float32


def placement_problem(device: Any, dtype: Any, device_map: Any = None, max_memory: Any = None,
                      offload_folder: Any = None) -> str | None:
    """Why a model's placement options cannot work on any machine (an unknown dtype, a device name torch
    does not know or the ``meta`` device, which holds no data; ``max_memory`` or ``offload_folder`` without a
    ``device_map``), or None. Checked when a metric is configured, before anything loads."""
    if dtype is not None and not isinstance(dtype, torch.dtype) and str(dtype).lower() not in _DTYPES:
        return f"dtype {dtype!r} is not a floating-point dtype for weights; use one of {sorted(_DTYPES)}"
    if device is not None:
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            return f"device {device!r} is not a device name (cpu, cuda, cuda:1, mps)"
        if parsed.type == "meta":
            return "device 'meta' holds no data (nothing can be scored on it); use cpu, cuda or mps"
    if device_map is None and (max_memory is not None or offload_folder is not None):
        return "max_memory and offload_folder only apply with a device_map (e.g. device_map='auto')"
    return device_map_problem(device_map)


STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def device_map_problem(device_map: Any) -> str | None:
    """Why ``device_map`` is neither a placement strategy, a device nor a mapping of module names to devices
    (GPU indices, ``cpu``, ``disk``, device names), or None."""
    try:
        frozen = freeze_device_map(device_map)
    except ValueError as err:
        return str(err)
    if frozen is None or (isinstance(frozen, str) and frozen in STRATEGIES):
        return None
    for target in ([frozen] if not isinstance(frozen, tuple) else [dev for _, dev in frozen]):
        if isinstance(target, bool) or (isinstance(target, int) and target < 0):
            return f"device_map names {target!r}, not a device"
        if isinstance(target, int) or target == "disk":
            continue
        try:
            torch.device(target)
        except (RuntimeError, TypeError, ValueError):
            where = "" if not isinstance(frozen, tuple) else " in it"
            return (f"device_map {device_map!r}: {target!r}{where} is neither one of {STRATEGIES}, a device (cpu, "
                    "cuda:1, disk, a GPU index) nor a mapping of module names to devices")
    return None


def device_problem(device: Any) -> str | None:
    """Why ``device`` is not on this machine (CUDA or MPS unavailable, a GPU index past the last), or None."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"device {device!r} is not a device name (cpu, cuda, cuda:1, mps)"
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"device {device!r}: no CUDA GPU is available on this machine; use --device cpu"
        if parsed.index is not None and parsed.index >= count:
            return f"device {device!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
    elif parsed.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        return f"device {device!r}: MPS (Apple GPUs) is not available on this machine; use --device cpu"
    elif parsed.type not in ("cpu", "cuda", "mps"):
        backend = getattr(torch, parsed.type, None)
        available = getattr(backend, "is_available", None)
        if callable(available) and not available():
            return f"device {device!r}: no {parsed.type} device is available on this machine"
        try:  # a type torch parses but this build cannot use (vulkan, opengl, ...): an empty tensor says so
            torch.empty(0, device=parsed)
        except Exception as err:  # noqa: BLE001  (RuntimeError, NotImplementedError, AssertionError by backend)
            return f"device {device!r} cannot be used by this torch build ({type(err).__name__}); use cpu or cuda"
    return None


def _source_key(name_or_path: str) -> str:
    return os.path.realpath(name_or_path) if os.path.isdir(name_or_path) else name_or_path


def hub_kwargs(revision: str | None, local_files_only: bool | None, trust_remote_code: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": bool(trust_remote_code)}
    if revision is not None:
        kwargs["revision"] = revision
    if local_files_only is not None:
        kwargs["local_files_only"] = bool(local_files_only)
    return kwargs


def shared(key: Hashable, factory: Callable[[], Any], sources: tuple[str | os.PathLike, ...] = ()) -> Any:
    """Build once per process per key; later callers get the same object while the local files it was built
    from are unchanged: ``sources`` and the ``model`` of every :class:`ModelSpec` in ``key``, stamped by each
    file's size, modification time and inode (:func:`files_stamp`). A model folder rewritten since (new weights
    saved over the old ones) is loaded again and checked whole, never scored with what the process held before;
    a warning says that scores before and after come from different weights."""
    stamp = tuple(_stamp(path, revision) for path, revision in (*((p, None) for p in sources), *_spec_models(key)))
    with _lock:
        held = _cache.get(key)
        if held is not None and held[0] != stamp:
            del _cache[key]  # freed before the new one is built
            named = _named(sources, key)
            warn_once(("reloaded", named, stamp), f"the files of {named} changed since this process loaded them: "
                      "loaded again (checked whole); scores before and after come from different weights")
        if key not in _cache:
            _cache[key] = (stamp, factory())
        return _cache[key][1]


def _stamp(path: str | os.PathLike, revision: str | None) -> tuple | None:
    """:func:`files_stamp` of a local file or folder, or of the cached snapshot a hub id resolves to now (a new
    commit fetched since is another snapshot)."""
    local = os.path.expanduser(os.fspath(path))
    if os.path.exists(local):
        return files_stamp(local)
    folder = source_folder(os.fspath(path), revision)
    return None if folder is None else (folder, files_stamp(folder))


def _spec_models(key: Any) -> list[tuple[str, str | None]]:
    if isinstance(key, ModelSpec):
        return [(key.model, key.revision)]
    return [m for item in key for m in _spec_models(item)] if isinstance(key, tuple) else []


def _named(sources: tuple, key: Any) -> str:
    names = [os.fspath(path) for path in (*sources, *(model for model, _ in _spec_models(key)))]
    return ", ".join(dict.fromkeys(names)) or "a model"


def load_model(
    loader: Any,
    name_or_path: str,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    gpu_dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    local_files_only: bool | None = None,
    trust_remote_code: bool = False,
    device_map: Any = None,
    max_memory: Any = None,
    offload_folder: str | None = None,
    share: bool = True,
    allow_missing: tuple[str, ...] = (),
    **kwargs: Any,
) -> Any:
    """``loader.from_pretrained(name_or_path)`` in eval mode on the resolved device and dtype, without
    gradients; shared with every caller that asks for the same thing, unless ``share=False`` (a model that
    will be changed in place, e.g. by injecting LoRA layers, must be a copy of its own).

    The model is checked whole (:mod:`capeval_plugins.resources.wholeness`): a local folder's config.json against its
    weights' headers before anything is built, then transformers' loading report and every value; any fault, and
    any failure of the loader itself, is one :class:`ModelLoadError` naming the file. ``allow_missing``: patterns
    (regular expressions) of parameters the caller initialises on purpose, which the weights need not hold.

    With a ``device_map`` the model is placed by transformers and accelerate (``max_memory`` caps each device,
    ``offload_folder`` holds what goes to disk) and left where it was put; ``device`` then only says where
    its inputs start (:func:`input_device`), so it is not part of what is shared: two callers with the same
    map share one copy."""
    if not name_or_path:
        raise ValueError("no model given (a hub id or a local path)")
    device_map, max_memory = freeze_device_map(device_map), freeze_max_memory(max_memory)
    if device_map is None and (max_memory is not None or offload_folder is not None):
        raise ValueError("max_memory and offload_folder only apply with a device_map (e.g. device_map='auto')")
    dev = resolve_device(device) if device_map is None else _map_device(device_map, device)
    dt = resolve_dtype(dtype, dev, gpu_dtype)
    folder = None if offload_folder is None else _folder(offload_folder)
    where = str(dev) if device_map is None else ("device_map", device_map, max_memory, folder)
    key = ("model", loader.__name__, _source_key(name_or_path), revision, where, str(dt), bool(trust_remote_code),
           tuple(sorted(kwargs.items())), tuple(allow_missing))

    def build() -> Any:
        source = check_source(name_or_path, revision)
        placement: dict[str, Any] = {}
        if device_map is not None:
            require_accelerate("a device_map")
            placement = {"device_map": _thaw(device_map), "max_memory": _thaw(max_memory), "offload_folder": folder}
            placement = {k: v for k, v in placement.items() if v is not None}
        hub = hub_kwargs(revision, local_files_only, trust_remote_code)
        with loader_boundary("model", name_or_path):
            label = wholeness.WEIGHTS_FILE
            if source is not None:
                label = wholeness.check_before_build(loader, name_or_path, source, hub, kwargs, allow_missing)
            model, info = loader.from_pretrained(name_or_path, dtype=dt, use_safetensors=True, output_loading_info=True,
                                                 ignore_mismatched_sizes=True, **hub, **placement, **kwargs)
            problem = wholeness.loaded_problem(model, info, label, allow_missing)
            if problem is None:
                if device_map is None:  # (a dispatched model stays where accelerate put it)
                    model = model.to(dev)  # first: a model bound for a GPU needs no copy of its own on the CPU
                problem = wholeness.values_problem(model, label)  # the values checked are the values scored
            if problem:
                raise ModelLoadError(f"cannot load model {name_or_path!r}: {problem}")
        return model.eval().requires_grad_(False)

    return shared(key, build, (name_or_path,)) if share else build()


def without_pooler(spec: ModelSpec) -> dict[str, bool]:
    """``add_pooling_layer=False`` for ``AutoModel`` where the checkpoint's architecture takes it, for an encoder
    whose pooler is never read: AutoModel would add one at random where the checkpoint ships none, and a model
    holding a tensor no checkpoint holds is not whole. An architecture without the option (DINOv2) is built as it
    is."""
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    config = load_config(spec.model, **spec.hub())
    try:
        architecture = MODEL_MAPPING[type(config)]
    except KeyError:  # a configuration transformers does not map (remote code)
        return {}
    return {"add_pooling_layer": False} if "add_pooling_layer" in inspect.signature(architecture).parameters else {}


def load_spec(loader: Any, spec: ModelSpec, *, gpu_dtype: torch.dtype = torch.float32, share: bool = True,
              **kwargs: Any) -> Any:
    """:func:`load_model` with everything a :class:`ModelSpec` says (checkpoint, device, dtype, hub options,
    placement)."""
    return load_model(loader, spec.model, device=spec.device, dtype=spec.dtype, gpu_dtype=gpu_dtype, share=share,
                      **spec.hub(), **spec.placement(), **kwargs)


def require_accelerate(what: str) -> None:
    if importlib.util.find_spec("accelerate") is None:
        raise MissingExtra(f"{what} needs accelerate, which is not installed: {ACCELERATE_EXTRA}")


def _map_device(device_map: Any, device: str | torch.device | None) -> torch.device:
    """The device a placed model computes on first, for choosing its default dtype (bfloat16 where a GPU
    takes part): ``device`` when given, else the map's first accelerator, else CPU."""
    if device is not None:
        return torch.device(device)
    if isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        return resolve_device(None)
    targets = [device_map] if not isinstance(device_map, tuple) else [d for _, d in device_map]
    accelerators = [d for d in targets if d not in ("cpu", "disk")]
    return torch.device(accelerators[0]) if accelerators else torch.device("cpu")


def is_dispatched(model: Any) -> bool:
    """Whether accelerate placed ``model`` with hooks (over several devices, or partly offloaded)."""
    return any(dispatch_hook(module) is not None for module in model.modules())


def input_device(model: Any, device: str | torch.device | None = None) -> torch.device:
    """Where a loaded model's inputs start and its outputs are gathered.

    A model on one device: that device. A dispatched model (:func:`is_dispatched`): ``device`` when given,
    else the device its input embeddings compute on (accelerate's execution device: for embeddings offloaded
    to CPU or disk, the accelerator they are brought to)."""
    if not is_dispatched(model):
        return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    if device is not None:
        return torch.device(device)
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    for module in (embeddings, model):
        execution = execution_device(module)
        if execution is not None:
            return torch.device(execution)
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def load_processor(
    loader: Any,
    name_or_path: str,
    *,
    revision: str | None = None,
    local_files_only: bool | None = None,
    trust_remote_code: bool = False,
    **kwargs: Any,
) -> Any:
    key = ("processor", loader.__name__, _source_key(name_or_path), revision, bool(trust_remote_code),
           tuple(sorted(kwargs.items())))
    def build() -> Any:
        folder = check_source(name_or_path, revision)
        hub = hub_kwargs(revision, local_files_only, trust_remote_code)
        with loader_boundary("processor", name_or_path):
            processor = loader.from_pretrained(name_or_path, **hub, **kwargs)
            if image_processors.torchvision_backend(processor) and \
                    not image_processors.saved_fast(source_folder(name_or_path, revision)):
                processor = loader.from_pretrained(name_or_path, **hub, **kwargs, **image_processors.pil_backend())
            check_vocabulary(processor, name_or_path, hub)
            check_tokenizer(processor, name_or_path, folder)
            check_against_model(processor, name_or_path, hub)
        return processor

    return shared(key, build, (name_or_path,))


def clear_cache() -> None:
    """Drop every shared model (frees memory once no metric holds them)."""
    with _lock:
        _cache.clear()


def source_key(name_or_path: str) -> str:
    """A hub id as it is; a local folder by its real path."""
    return _source_key(name_or_path)


def local_path_problem(value: str) -> str | None:
    """Why ``value``, written as a local path, does not exist or is neither a file nor a folder (a FIFO or a
    device would block or stream forever when read); None when it is one, or reads as a hub id (``org/name``,
    ``name``), which only the loader can check."""
    path = os.path.expanduser(value)
    if os.path.exists(path):
        if os.path.isfile(path) or os.path.isdir(path):
            return None
        mode = os.stat(path).st_mode
        kind = "FIFO" if stat.S_ISFIFO(mode) else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "socket"
        return f"{value} is a {kind}, not a file or a folder"
    local = os.path.isabs(value) or value.startswith(("./", "../", "~", ".\\")) or value.count("/") > 1 or "\\" in value
    return f"no such file or folder: {value}" if local else None


# Text files a loader parses whole (configs, tokenizers, vocabularies, weight indexes). The largest real ones are
# tokenizer.json files of big vocabularies: Qwen's 18.7 MB, Mistral's Tekken 19.3 MB, Gemma 3's about 33 MB; a
# parsed JSON file costs about four times its size, so twice the largest real one is the bound (a 200 MB file
# cost 800 MB, then a traceback).
MAX_TEXT_FILE = 64 * 2**20
_TEXT_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab", ".py")


def source_folder(name_or_path: str, revision: str | None = None) -> str | None:
    """The folder a loader reads: a local folder, or a hub id's cached snapshot of ``revision`` (None when
    it is not cached: the hub client fetches what it needs then)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.path.exists(name_or_path) or name_or_path.count("/") > 1:
        return None
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    repo = os.path.join(constants.HF_HUB_CACHE, f"models--{name_or_path.replace('/', '--')}")
    commit = revision or "main"
    try:
        with open(os.path.join(repo, "refs", commit), encoding="utf-8") as f:
            commit = f.read(100).strip() or commit
    except OSError:
        pass
    folder = os.path.join(repo, "snapshots", commit)
    return folder if os.path.isdir(folder) else None


UNFINISHED_DOWNLOAD = ".aria2"  # aria2 (and hfd.sh, which drives it) keeps this beside a file until it is whole


def check_source(name_or_path: str, revision: str | None = None) -> str | None:
    """Refuse, in one line naming the file, a model folder a loader would hang on or be misled by: every entry
    must be a regular file or a folder (a FIFO, a device, a link to ``/dev/zero`` is refused), no download
    unfinished (:data:`UNFINISHED_DOWNLOAD`), a text file no larger than :data:`MAX_TEXT_FILE`, and every
    ``.safetensors`` file's header consistent with its size
    (:mod:`capeval_plugins.resources.tensorfile`). Hidden names (``.git``, ``.cache``) are not read by loaders.
    Returns the folder checked (None for a hub id not in the cache)."""
    from capeval_plugins.resources import tensorfile

    problem = local_path_problem(name_or_path)
    if problem:  # (the hub client would take a missing folder for a malformed repo id)
        raise ModelLoadError(f"cannot load {name_or_path!r}: {problem}")
    folder = source_folder(name_or_path, revision)
    if folder is None:
        return None
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError as err:
                raise ModelLoadError(f"cannot load {name_or_path!r}: {path} cannot be read ({err.strerror})") from None
            if not stat.S_ISREG(st.st_mode):
                kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
                raise ModelLoadError(f"cannot load {name_or_path!r}: {path} is a {kind}, not a regular file (a model "
                                     "folder holds regular files only)")
            if name.endswith(_TEXT_SUFFIXES) and st.st_size > MAX_TEXT_FILE:
                raise ModelLoadError(f"cannot load {name_or_path!r}: {path} has {st.st_size} bytes, more than any "
                                     f"real model's configuration or tokenizer file ({MAX_TEXT_FILE} at most)")
            if name.endswith(UNFINISHED_DOWNLOAD):
                raise ModelLoadError(f"cannot load {name_or_path!r}: {path} says the download of {name[:-6]} is not "
                                     "finished (aria2's control file; a pre-allocated file holds zeros where it has "
                                     "no data yet): finish it, or copy the model folder again")
            if name.endswith(".safetensors"):
                try:
                    tensorfile.check_file(path)
                except tensorfile.TensorFileError as err:
                    raise ModelLoadError(f"cannot load {name_or_path!r}: {err}") from None
    return folder


def folder_problem(name_or_path: str, revision: str | None = None) -> str | None:
    """What can be told of a model folder without loading anything, as one line, or None: :func:`check_source`,
    then its config.json's sizes against its weights' headers (a diffusers pipeline: each part's). The command
    line asks before any work (:mod:`capeval_plugins.preflight`); loading asks again."""
    try:
        folder = check_source(name_or_path, revision)
        if folder is None:
            return None
        with loader_boundary("model", name_or_path):
            if os.path.isfile(os.path.join(folder, "model_index.json")):
                wholeness.pipeline_parts(folder)
            elif os.path.isfile(os.path.join(folder, "config.json")):
                wholeness.check_config(name_or_path, folder)
    except ModelLoadError as err:
        return str(err)
    return None


def load_config(name_or_path: str, revision: str | None = None, local_files_only: bool | None = None,
                trust_remote_code: bool = False) -> Any:
    """A checkpoint's transformers configuration, its folder checked first (:func:`check_source`); any failure is
    one :class:`ModelLoadError`."""
    from transformers import AutoConfig

    check_source(name_or_path, revision)
    with loader_boundary("the configuration of", name_or_path):
        return AutoConfig.from_pretrained(name_or_path, **hub_kwargs(revision, local_files_only, trust_remote_code))


def check_tokenizer(loaded: Any, name_or_path: str, folder: str | None) -> None:
    """Refuse a tokenizer (or a processor's) whose tokenizer.json is not whole (:func:`wholeness.tokenizer_problem`:
    e.g. a BPE vocabulary without its merges), naming the file."""
    tokenizer = _tokenizer_of(loaded)
    if tokenizer is None:
        return
    path = os.path.join(folder, "tokenizer.json") if folder else None
    if path is not None and os.path.isfile(path):
        data, where = wholeness.read_tokenizer_json(path), path
    elif hasattr(tokenizer, "backend_tokenizer"):
        import json

        data, where = json.loads(tokenizer.backend_tokenizer.to_str()), f"the tokenizer of {name_or_path!r}"
    else:
        return
    problem = wholeness.tokenizer_problem(data)
    if problem:
        raise ModelLoadError(f"cannot load the tokenizer of {name_or_path!r}: {where}: {problem}; copy the model "
                             "folder again")


def _tokenizer_of(loaded: Any) -> Any:
    if callable(getattr(loaded, "convert_tokens_to_ids", None)):
        return loaded
    return getattr(loaded, "tokenizer", None)


def check_against_model(loaded: Any, name_or_path: str, hub: Mapping[str, Any]) -> None:
    """:func:`agreement.check_against_model` with the folder's configuration, read once."""
    from capeval_plugins.resources import agreement

    agreement.check_against_model(loaded, name_or_path, _model_config(name_or_path, hub), _tokenizer_of(loaded))


def _model_config(name_or_path: str, hub: Mapping[str, Any]) -> Any:
    """The folder's ``config.json`` as transformers reads it (None without one)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name_or_path, **hub)
    except Exception:  # no config (a processor-only folder), a model type this transformers does not know
        return None


def _config_vocabulary(name_or_path: str, hub: Mapping[str, Any]) -> int | None:
    """The text model's vocabulary size in the folder's ``config.json`` (None without one)."""
    config = _model_config(name_or_path, hub)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def vocabulary_problem(tokenizer: Any, model_vocabulary: int | None) -> str | None:
    """Why ``tokenizer`` is not the complete vocabulary of a model whose embedding table has
    ``model_vocabulary`` rows, or None. A tokenizer whose vocabulary file is missing still loads, with its
    special tokens only (every word becomes one unknown id); checkpoints pad their embedding tables a little
    (to a multiple of 64 or 128), so a shortfall of at most max(256, vocabulary / 128) is allowed."""
    size = len(tokenizer)
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if isinstance(t, str)]
    if size <= len(set(specials)) + 1:
        return f"its vocabulary holds {size} tokens, only its special tokens"
    if model_vocabulary is not None and model_vocabulary - size > max(256, model_vocabulary // 128):
        return f"its vocabulary holds {size} tokens but the model's has {model_vocabulary}"
    unk = getattr(tokenizer, "unk_token", None)
    for token in specials:
        ids = tokenizer.convert_tokens_to_ids([token])
        if not ids or ids[0] is None or (token != unk and ids[0] == getattr(tokenizer, "unk_token_id", None)):
            return f"its special token {token!r} is not in its vocabulary"
    return None


def check_vocabulary(loaded: Any, name_or_path: str, hub: Mapping[str, Any]) -> None:
    """Refuse a tokenizer (or a processor's) that loaded without its vocabulary, naming the files missing."""
    tokenizer = _tokenizer_of(loaded)
    if tokenizer is None:
        return
    try:
        len(tokenizer)
    except TypeError:
        return
    model_vocabulary = _config_vocabulary(name_or_path, hub)
    problem = vocabulary_problem(tokenizer, model_vocabulary)
    if problem is None:
        return
    folder = source_folder(name_or_path, hub.get("revision"))
    wanted = list(dict.fromkeys(getattr(type(tokenizer), "vocab_files_names", {}).values()))
    missing = [f for f in wanted if folder is None or not os.path.isfile(os.path.join(folder, f))]
    where = f" ({', '.join(missing)} missing" + (f" in {folder})" if folder else ")") if missing else ""
    raise ModelLoadError(f"cannot load the tokenizer of {name_or_path!r}: {problem}: its vocabulary file is missing "
                         f"or incomplete{where}; copy the model folder again")
