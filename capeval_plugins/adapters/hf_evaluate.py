"""Hugging Face ``evaluate`` adapter, generic over the contract.

Every registered metric loads with ``evaluate.load(name, **options)`` and ``evaluate.load("capeval/" +
name, ...)``, offline, with no import of ours (see :mod:`evaluate_hook`). Names of canonical evaluate
modules are never shadowed: such metrics answer only to ``capeval/<name>``. The fallback that needs no
hook is ``evaluate.load(module_file("clipscore"))``.

``compute(images=..., predictions=..., references=...)`` returns ``{<name>: corpus score, "scores":
[per sample, input order], **extras}``; ``add_batch`` accumulates as with any evaluate metric.
"""
from __future__ import annotations

import dataclasses
import hashlib
import sys
import types
import warnings
from pathlib import Path
from typing import Any

from capeval_plugins import __version__, registry
from capeval_plugins.cards import card_body
from capeval_plugins.contract import MetricInfo
from capeval_plugins.files import paths
from capeval_plugins.core.messages import require, warn_once

# the ecosystem this adapter plugs into: without it, one line naming the extra that installs it
evaluate = require("evaluate", "evaluate", "capeval_plugins.adapters.hf_evaluate (evaluate.load)")
import datasets  # noqa: E402  (installed with evaluate)
from evaluate.loading import ImportableModule  # noqa: E402

from capeval_plugins.adapters import evaluate_hook as internals  # noqa: E402  (evaluate's internals, one place)
from capeval_plugins.adapters.evaluate_hook import CANONICAL  # noqa: E402,F401  (re-exported)

internals.check()  # evaluate's internals used here are where they were on the versions checked

# Keyword arguments of evaluate.EvaluationModule.__init__; everything else is a metric option.
EVALUATE_ARGS = frozenset(
    "config_name keep_in_memory cache_dir num_process process_id seed experiment_id hash "
    "max_concurrent_cache_files timeout".split()
)
MODULE_PACKAGE = "capeval_plugins.adapters._evaluate_modules"
NO_ID = -1  # the ``ids`` column of a sample added without one
SINGULAR = ("image", "group_id", "id")  # add()'s names of add_batch()'s image, group_ids, ids


def given_ids(ids: Any) -> list[int] | None:
    """The sample ids the batches were added with, or None when none was. Per-sample results come back in the
    order of these ids: the input order of the whole corpus however processes (``num_process``) split it, where
    evaluate hands process 0 every process's rows one process after the other."""
    if ids is None or all(i == NO_ID for i in ids):
        return None
    if any(i == NO_ID for i in ids):
        from capeval_plugins.inputs import InputError

        raise InputError("ids: given for some batches (or processes) and not others; give every sample its id, "
                         "or none")
    return [int(i) for i in ids]


def evaluate_names() -> dict[str, str]:
    """Every name ``evaluate.load`` accepts for a capeval metric -> registry name."""
    names = {}
    for name in registry.metrics():
        names["capeval/" + name] = name
        if name not in CANONICAL:
            names[name] = name
    return names


def class_name(name: str) -> str:
    # evaluate derives module_name by camelcase_to_snakecase(class name): "msd_score" <-> "MsdScore".
    return "".join(part.capitalize() for part in name.split("_"))


def features(info: MetricInfo) -> list[datasets.Features]:
    """One key set (evaluate requires it), several value types: references as lists or single strings,
    images or videos (lists of frames)."""
    image_types: list[Any] = []
    if info.images != "never":
        image_types.append(datasets.Image(decode=False))
        if info.video:
            image_types.append(datasets.Sequence(datasets.Image(decode=False)))
    ref_types: list[Any] = []
    if info.references != "never":
        ref_types = [datasets.Sequence(datasets.Value("string")), datasets.Value("string")]
    options = []
    for image in image_types or [None]:
        for ref in ref_types or [None]:
            spec = {"predictions": datasets.Value("string")}
            if ref is not None:
                spec["references"] = ref
            if image is not None:
                spec["images"] = image
            if info.groups:
                spec["group_ids"] = datasets.Value("int64")
            spec["ids"] = datasets.Value("int64")  # optional sample ids (-1: not given)
            options.append(datasets.Features(spec))
    return options


class CapevalEvaluationModule(evaluate.Metric):
    """Base of the generated evaluate modules; ``_capeval_name`` says which registered metric."""

    _capeval_name: str = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in EVALUATE_ARGS}
        options.update(self._clashing_options(kwargs))
        self.capeval_metric = registry.load(self._capeval_name, **options)  # unknown options fail here
        self._capeval_options = options
        super().__init__(*args, **kwargs)

    @classmethod
    def _clashing_options(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Arguments of ``evaluate.load`` named like one of the metric's options: ``seed`` is the metric's too
        (evaluate's own seeds the global generators around ``compute``, which capeval's metrics never read);
        ``cache_dir`` stays evaluate's, with a warning that the metric's goes to ``compute``. Either reached
        evaluate alone before, and the metric kept its default without a word."""
        fields = {f.name for f in dataclasses.fields(registry.get(cls._capeval_name).cls.Config)}
        given = {k: v for k, v in kwargs.items() if k in fields and v is not None}
        if "cache_dir" in given:
            warnings.warn(f"{cls._capeval_name}: cache_dir given to evaluate.load is evaluate's cache; the metric's "
                          "own cache_dir goes to compute(cache_dir=...)", stacklevel=4)
        return {k: v for k, v in given.items() if k == "seed"}

    def _info(self) -> evaluate.MetricInfo:
        entry = registry.get(self._capeval_name)
        info = entry.info
        return evaluate.MetricInfo(
            module_type="metric",
            description=info.description,
            citation=info.citation,
            inputs_description=card_body(entry.cls),
            features=features(info),
            homepage=info.paper,
            codebase_urls=list(info.codebase_urls),
            reference_urls=[info.paper] if info.paper else [],
        )

    def _placeholders(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Fill optional inputs the user left out (evaluate needs every feature column) and turn tensors
        and arrays into PIL images (Arrow cannot store them)."""
        from capeval_plugins.inputs import InputError, check_group_ids, image_source

        info = self.capeval_metric.info
        predictions = inputs["predictions"]
        if predictions is None or isinstance(predictions, str):
            raise InputError("predictions must be a list of captions")
        n = len(predictions)
        offset = getattr(self, "_capeval_added", 0)  # samples added by earlier add_batch calls
        _refuse_text_arrow_cannot_store(predictions, inputs.get("references"),
                                        _sample_names(inputs.get("ids"), offset, n))
        if info.references != "never" and inputs.get("references") is None:
            inputs["references"] = [[] for _ in range(n)]
        if info.groups and inputs.get("group_ids") is None:
            inputs["group_ids"] = [None] * n  # grouped by image, as when no batch gives group ids
        elif info.groups:  # as the core reads them (names hashed, floats refused), before Arrow casts them
            inputs["group_ids"] = check_group_ids(inputs["group_ids"], n)
        if inputs.get("ids") is None:
            inputs["ids"] = [NO_ID] * n
        else:
            self._capeval_with_ids = True
        images = inputs.get("images")
        if info.images != "never" and images is None:
            inputs["images"] = [None] * n
        elif images is not None:
            inputs["images"] = [_arrow_image(image_source, img, i) for i, img in enumerate(images)]
        return inputs

    def add(self, *, prediction=None, reference=None, **kwargs):
        """Add one sample (``prediction``, its ``reference(s)`` and ``image``/``group_id``/``id`` as the metric
        takes them): :meth:`add_batch` of a batch of one, so the inputs it leaves out are filled the same way."""
        batch = {f"{k}s" if k in SINGULAR else k: [v] for k, v in kwargs.items()}
        return self.add_batch(predictions=[prediction], references=None if reference is None else [reference],
                              **batch)

    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """Add a batch: ``predictions`` (captions), ``references`` and ``images`` as the metric needs. A batch
        that is refused discards the batches added before it too (a later ``compute()`` would otherwise score
        a corpus with a hole, or mix them into the next one): add them again."""
        try:
            inputs = self._placeholders({"predictions": predictions, "references": references, **kwargs})
            added = super().add_batch(**inputs)
        except Exception as err:
            self._discard(err)
            raise
        self._capeval_added = getattr(self, "_capeval_added", 0) + len(inputs["predictions"])
        return added

    def compute(self, *, predictions=None, references=None, **kwargs):
        """Score everything added so far plus the inputs given here; returns ``{<name>: corpus score,
        "scores": [per sample, input order], **extras}`` on process 0 (None elsewhere). Whatever happens,
        nothing added so far is kept for the next ``compute()``."""
        self._capeval_before = getattr(self, "_capeval_added", 0)  # (evaluate adds the inputs given here too)
        try:
            with_ids = getattr(self, "_capeval_with_ids", False) or kwargs.get("ids") is not None
            if getattr(self, "num_process", 1) > 1 and self.process_id == 0 and not with_ids:
                warn_once(("evaluate-ids", self._capeval_name), (
                    f"{self._capeval_name}: num_process={self.num_process}: per-sample results come back in process "
                    "order (process 0's samples, then process 1's, ...), which is input order only when each process "
                    "holds a contiguous part; add the samples with ids=<their dataset indices> for input order"))
            if predictions is None:  # everything was added with add_batch
                return super().compute(references=references, **kwargs)
            inputs = self._placeholders({"predictions": predictions, "references": references, **kwargs})
            return super().compute(**inputs)
        except Exception as err:
            self._discard(err)
            raise
        finally:
            self._capeval_added, self._capeval_with_ids, self._capeval_before = 0, False, None

    def _discard(self, err: Exception) -> None:
        """Drop the batches added so far (evaluate keeps them in a writer until compute() reads them)."""
        from capeval_plugins import files

        had = getattr(self, "_capeval_added", 0)
        if getattr(self, "_capeval_before", None) is not None:  # in compute(): only what add_batch() added
            had = self._capeval_before
        self._capeval_added = 0
        internals.discard(self, lambda folder: files.Folder.open(folder)[0])
        if had and hasattr(err, "add_note"):
            err.add_note(f"(the {had} samples added before were discarded: add them again)")

    def _compute(self, predictions, references=None, images=None, group_ids=None, ids=None, progress: bool = False,
                 **options: Any):
        if references is not None and all(not r for r in references):
            references = None
        if images is not None and all(img is None for img in images):
            images = None
        if group_ids is not None and all(g is None for g in group_ids):
            group_ids = None
        ids = given_ids(ids)
        metric = self._metric_for(options)
        result = metric(images, predictions, references, group_ids=group_ids, ids=ids, progress=progress)
        return result.to_dict()

    def _metric_for(self, options: dict[str, Any]) -> Any:
        """The metric with compute-time options on top of the load-time ones (evaluate's convention:
        ``compute(..., sigma=3.0)``). A metric may also take its reference implementation's argument names
        (BERTScore: bert_score's ``lang``, ``model_type``, ...) through ``reference_options``."""
        if not options:
            return self.capeval_metric
        translate = getattr(type(self.capeval_metric), "reference_options", None)
        if translate is not None:
            options = translate(options, named=tuple(self._capeval_options))
        merged = {**self._capeval_options, **options}
        if merged == self._capeval_options:
            return self.capeval_metric
        return registry.load(self._capeval_name, **merged)


def _refuse_text_arrow_cannot_store(predictions: Any, references: Any, names: list[int]) -> None:
    """The core's own checks (``inputs.caption_problem``, ``inputs.reference_problem``) on the samples whose texts
    Arrow would not store as given, raised as the core raises them: anything but a string (Arrow fails without
    naming the sample, or stores a number as its digits) and a lone surrogate (a bare UnicodeEncodeError). The
    other problems (a NUL, an empty reference) Arrow stores; the core finds them at ``compute()``, under the
    metric's ``on_error``."""
    from capeval_plugins.inputs import ProblemReport, caption_problem, reference_problem

    found = [(name, caption_problem(prediction)) for name, prediction in zip(names, predictions)
             if not _arrow_stores(prediction)]
    for name, refs in zip(names, references if references is not None and not isinstance(references, str) else ()):
        texts = [refs] if isinstance(refs, str) else list(refs) if isinstance(refs, (list, tuple)) else [refs]
        if refs is not None and not all(_arrow_stores(text) for text in texts):
            found.append((name, reference_problem(refs)))
    report = ProblemReport()
    for name, problem in found:
        if problem is not None:  # a numpy array of strings: Arrow stores it, and the core takes it
            report.add(name, problem)
    if report:
        raise report.error()


def _arrow_stores(text: Any) -> bool:
    """Whether Arrow stores ``text`` as the string it is: a string without a lone surrogate."""
    if not isinstance(text, str):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _sample_names(ids: Any, first: int, n: int) -> list[int]:
    """How errors name a batch's samples, as the core does: by the ids given with them, else by their position
    over all ``add_batch`` calls."""
    values = ids.tolist() if hasattr(ids, "tolist") else ids
    if isinstance(values, (list, tuple)) and len(values) == n and all(
            isinstance(v, int) and not isinstance(v, bool) for v in values):
        return list(values)
    return list(range(first, first + n))


def _arrow_image(image_source, image: Any, index: int) -> Any:
    """Paths, dicts and bytes go to Arrow as they are (a file or its bytes, decoded at compute time as every
    entry point decodes them); integer ids as strings (Arrow stores them as ``{"path": id}``, for metrics that
    find their images by id). PIL images, arrays and tensors become the RGB image every other entry point
    decodes (validated here, so a bad one is reported with its sample index), as a new image without a file
    or a format: Arrow would store an opened image by its file name (the file's pixels, not the object's) and
    re-encode a JPEG-decoded one as a JPEG (other pixels); a new image it stores losslessly (PNG)."""
    import numpy as np
    import torch
    from PIL import Image

    if isinstance(image, (list, tuple)):
        return [_arrow_image(image_source, frame, index) for frame in image]
    if isinstance(image, (int, np.integer)) and not isinstance(image, bool):
        return str(image)
    if isinstance(image, (np.ndarray, torch.Tensor, Image.Image)):
        decoded = image_source(image, index).load()
        return decoded.copy() if decoded is image else decoded
    return image


def evaluation_class(name: str) -> type[CapevalEvaluationModule]:
    """The evaluate module class of a registered metric (one class per name, built once)."""
    module = _module(name)
    return getattr(module, class_name(name))


def _module(name: str) -> types.ModuleType:
    module_name = f"{MODULE_PACKAGE}.{name}"
    if module_name not in sys.modules:
        registry.get(name)  # a clear error for unknown names
        if MODULE_PACKAGE not in sys.modules:
            package = types.ModuleType(MODULE_PACKAGE)
            package.__path__ = []
            sys.modules[MODULE_PACKAGE] = package
        module = types.ModuleType(module_name, f"capeval metric {name!r} for Hugging Face evaluate")
        cls = type(class_name(name), (CapevalEvaluationModule,), {"_capeval_name": name, "__module__": module_name})
        module.__dict__[cls.__name__] = cls
        sys.modules[module_name] = module
    return sys.modules[module_name]


def importable_module(path: str) -> ImportableModule | None:
    """What ``evaluation_module_factory`` returns for ``path``, or None if it is not ours. Besides the registry
    names, the spellings the other adapters take find a metric (``"CIDEr"``, ``"ClipScore"``, ``"CLIPScore"``),
    except where they name a canonical evaluate module (``"METEOR"`` stays evaluate's; ``"capeval/METEOR"`` is
    ours)."""
    name = evaluate_names().get(path) or _spelling(path)
    if name is None:
        if path.startswith("capeval/"):
            registry.get(path)  # raises KeyError naming the registered metrics
        return None
    module = _module(name)
    digest = hashlib.sha256(f"capeval-plugins {__version__} {name}".encode()).hexdigest()
    return ImportableModule(module.__name__, digest)


def _spelling(path: str) -> str | None:
    """The registered metric another adapter's spelling of ``path`` names (see :func:`naming.lookup`)."""
    from capeval_plugins.adapters.naming import lookup

    bare = registry.canonical_name(path)
    if "/" in bare or not bare:
        return None
    name = lookup(bare)
    if name is None or (not path.startswith("capeval/") and (name in CANONICAL or bare.lower() in CANONICAL)):
        return None
    return name


def cache_root() -> Path:
    """Where the package writes into the user's cache: ``$CAPEVAL_CACHE``, else ``$XDG_CACHE_HOME/capeval_plugins``,
    else ``~/.cache/capeval_plugins`` (:func:`capeval_plugins.files.paths.cache_dir`)."""
    return paths.cache_dir()


def module_file(name: str, directory: str | Path | None = None) -> Path:
    """Write a two-line evaluate module script (and the metric card beside it) and return the script's
    path: ``evaluate.load(str(module_file("clipscore")))`` works without the start-up hook."""
    name = registry.canonical_name(name)
    entry = registry.get(name)
    root = Path(directory) if directory else cache_root() / "evaluate_modules"
    from capeval_plugins import files
    from capeval_plugins.cards import card_text

    folder = root / name
    files.Folder.open(folder, create=True)[0].close()
    script = folder / f"{name}.py"
    files.write_output(script, (
        f'"""capeval-plugins metric {name!r} for Hugging Face evaluate."""\n'
        "from capeval_plugins.adapters.hf_evaluate import evaluation_class\n\n"
        f"{class_name(name)} = evaluation_class({name!r})\n").encode(), what="evaluate module")
    files.write_output(folder / "README.md", card_text(entry.cls).encode(), what="metric card")
    return script
