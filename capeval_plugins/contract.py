"""The metric contract: map -> reduce -> finalize.

A metric is written once against this contract and every ecosystem adapter is generic over it:

* ``map(batch)`` turns one validated :class:`Batch` into tensors (numpy arrays for host states, see
  :class:`StateSpec`): per-sample rows (``"cat"`` states) or partial sums (``"sum"`` states), as declared by
  ``states()``;
* the reduce step merges those tensors across batches, streams and processes: :func:`merge_states`, the one
  reduce every entry point uses (the session's loop per batch and running sum, the runner per rank and across
  ranks in rank order, the torchmetrics adapter over each update and over its states gathered per rank, which
  torchmetrics' own reductions never touch);
* ``finalize(state)`` turns the merged state into a :class:`MetricResult`.

The contract itself adds three ``"cat"`` states to every metric: the global sample index (so repeated samples
are dropped and input order is restored whatever the batching or sharding), the group id (for metrics that
look at all candidates of one image) and a digest of each sample's content (so an index given twice for two
different samples is an error, never a silently dropped sample).

Why one module of ~970 lines: it is the whole contract a metric author reads (docs/contract.md follows it top to
bottom), its parts (states, info, batch, result, configuration, the Metric classes, the reduce and the finalize)
are short and refer to one another; the text codec the states use lives in :mod:`capeval_plugins.core.textcodec`,
and the few operations that take a numpy array or a tensor alike (host states) in :mod:`capeval_plugins.core.arrays`.
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Literal, Mapping, Sequence

import numpy as np

from capeval_plugins.core.arrays import as_tensor, host, is_host_dtype, is_tensor, kind_of, same_kind, take
from capeval_plugins.core.bounds import bounded, field_problem  # noqa: F401  (bounded: for metric configs)
from capeval_plugins.core.messages import DataError, install_extra
from capeval_plugins.core.textcodec import (PackedTexts, decode_text_lists, decode_texts,  # noqa: F401  (re-exported)
                                            encode_text_lists, encode_texts)

if TYPE_CHECKING:
    from torch import Tensor

INDEX = "index"
GROUP = "group"
DIGEST = "sample_digest"
CONTRACT_STATES = (INDEX, GROUP, DIGEST)  # added to every metric's own states (full_spec, map_batch)
Usage = Literal["never", "optional", "always"]


@dataclass(frozen=True)
class StateSpec:
    """How one state tensor merges: ``"cat"`` stacks per-sample rows of shape ``shape``; ``"sum"`` adds
    tensors of shape ``shape`` (sufficient statistics, float64 for anything squared).

    ``dtype``: a torch dtype (default ``torch.float64``), or a numpy dtype for a *host state*, numpy arrays in
    CPU memory in ``map``'s output and ``finalize``'s input. A metric whose states are all host states (the
    classic COCO metrics) gets host contract states too (:func:`full_spec`) and never imports torch; text
    states are always host states.

    A ``-1`` in a ``"cat"`` shape is a ragged axis: batches may differ in that width and are zero-padded to
    the widest when merged. ``text``: the rows are texts (:func:`encode_texts`, :func:`encode_text_lists`, which
    hold no zero byte; declare :data:`TEXT_STATE`): a batch is zero-padded as any ragged block, but the merged
    state is a :class:`PackedTexts`, every row's bytes back to back, so one long caption costs its own length,
    not its length times the number of rows."""

    reduce: Literal["cat", "sum"]
    dtype: Any = None
    shape: tuple[int, ...] = ()
    text: bool = False

    def __post_init__(self) -> None:
        if self.reduce not in ("cat", "sum"):
            raise ValueError(f"reduce must be 'cat' or 'sum', got {self.reduce!r}")
        if self.reduce == "sum" and -1 in self.shape:
            raise ValueError("a 'sum' state cannot have a ragged axis")
        if self.text:  # texts are bytes for finalize, in CPU memory: a host state whichever uint8 was written
            uint8 = str(self.dtype) == "torch.uint8" or is_host_dtype(self.dtype) and np.dtype(self.dtype) == np.uint8
            if (self.reduce, self.shape) != ("cat", (-1,)) or not uint8:
                raise ValueError('a text state is StateSpec("cat", np.uint8, (-1,), text=True)')
            object.__setattr__(self, "dtype", np.dtype(np.uint8))
        elif self.dtype is None:
            import torch

            object.__setattr__(self, "dtype", torch.float64)
        elif is_host_dtype(self.dtype):
            object.__setattr__(self, "dtype", np.dtype(self.dtype))
            if self.reduce == "sum" and self.dtype == np.uint64:
                raise ValueError("a uint64 'sum' state cannot be added as a tensor (torchmetrics, DDP): use np.int64")

    @property
    def host(self) -> bool:
        """Numpy arrays in CPU memory (a numpy ``dtype``), not tensors."""
        return isinstance(self.dtype, np.dtype)

    @property
    def ragged(self) -> bool:
        return -1 in self.shape

    def on_torch(self) -> "StateSpec":
        """This state as tensors of the same dtype, for an adapter that holds tensors (a text state: its
        zero-padded byte rows)."""
        if not self.host:
            return self
        from capeval_plugins.core.arrays import torch_dtype

        # torch adds no uint16 / uint32 tensors: such a sum is held as int64 (own_kind casts it back)
        wide = self.reduce == "sum" and self.dtype.kind == "u" and self.dtype.itemsize > 1
        return StateSpec(self.reduce, torch_dtype(np.dtype(np.int64) if wide else self.dtype), self.shape)

    def own_kind(self, value: Any) -> Any:
        """``value`` (this state's rows or sum, as an array or a tensor) as this state's kind: numpy for a host
        state (a text state's rows packed), a tensor otherwise. What an adapter that held a host state as a
        tensor (:meth:`on_torch`) hands back to ``finalize``."""
        if not self.host:
            return as_tensor(value)
        if self.text:
            return PackedTexts.join([value])
        return host(value).astype(self.dtype, copy=False)

    def empty(self, device: Any = None) -> Any:
        shape = (0, *(max(d, 0) for d in self.shape)) if self.reduce == "cat" else self.shape
        if self.host:
            return np.zeros(shape, dtype=self.dtype)
        import torch

        return torch.zeros(shape, dtype=self.dtype, device=device)

    def cat(self, rows: Sequence[Any]) -> Any:
        """Concatenate row blocks, zero-padding ragged axes to the widest block (a text state: packed)."""
        if self.text:
            return PackedTexts.join(rows)
        return self.cat_padded(rows)

    def cat_padded(self, rows: Sequence[Any]) -> Any:
        """:meth:`cat` as one zero-padded block, whatever the state (what a collective gathers)."""
        rows = [r.padded() if isinstance(r, PackedTexts) else r for r in rows]
        # each row block as this state's kind (a checkpoint's records are read back as arrays where they can be)
        rows = [host(r) if self.host else as_tensor(r) for r in rows]
        if not rows:
            return self.empty()
        if not self.ragged:
            if self.host:
                return np.concatenate([r.reshape(-1, *self.shape) for r in rows], axis=0).astype(self.dtype, copy=False)
            import torch

            return torch.cat([r.reshape(-1, *self.shape) for r in rows], dim=0)
        # one zero-filled block the size of the result, each part copied into its corner (padding every part
        # first and then concatenating copies everything twice)
        width = [max(r.shape[1 + i] for r in rows) for i in range(len(self.shape))]
        torch = None if self.host else __import__("torch")
        on_cpu = self.host or all(r.device.type == "cpu" for r in rows) and rows[0].dtype not in (torch.bfloat16,)
        shape = (sum(len(r) for r in rows), *width)
        out = np.zeros(shape, dtype=host(rows[0][:0]).dtype) if on_cpu else \
            torch.zeros(shape, dtype=rows[0].dtype, device=rows[0].device)
        start = 0
        for r in rows:  # numpy copies into a strided corner several times faster than torch does on a CPU
            corner = (slice(start, start + len(r)), *(slice(0, d) for d in r.shape[1:]))
            out[corner] = host(r) if on_cpu else r
            start += len(r)
        if self.host:
            return out.astype(self.dtype, copy=False)
        return torch.from_numpy(out) if on_cpu else out


# The state of texts kept for finalize (captions, references): packed once merged (PackedTexts).
TEXT_STATE = StateSpec("cat", np.uint8, (-1,), text=True)


@dataclass(frozen=True)
class MetricInfo:
    """What a metric is and what it needs; adapters build everything they show from this."""

    name: str
    display_name: str
    description: str
    citation: str
    references: Usage = "optional"
    images: Usage = "always"
    video: bool = False
    groups: bool = False
    higher_is_better: bool = True
    score_range: tuple[float, float] | None = None
    paper: str = ""
    paper_config: Mapping[str, Any] = field(default_factory=dict)
    text_input: Literal["raw", "ptb"] = "raw"
    codebase_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"metric name must be a lowercase identifier, got {self.name!r}")
        for attr in ("references", "images"):
            if getattr(self, attr) not in ("never", "optional", "always"):
                raise ValueError(f"MetricInfo.{attr} must be 'never', 'optional' or 'always'")


class _IndexField:
    """A :class:`Batch` field of int64 per-sample values, kept as given (a list, a numpy array or a tensor): read
    as a tensor, made on the first read (which imports torch), or as numpy through :meth:`Batch.host`, which a
    metric with host states reads, so that it never imports torch."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, batch: Any, owner: type | None = None) -> Any:
        if batch is None:
            return self
        value = getattr(batch, self.slot)
        if value is None or is_tensor(value):
            return value
        tensor = as_tensor(np.asarray(value, dtype=np.int64))
        setattr(batch, self.slot, tensor)
        return tensor

    def __set__(self, batch: Any, value: Any) -> None:
        setattr(batch, self.slot, value)


class Batch:
    """One validated batch. ``images`` holds each distinct image (or video: a list of frames) once and
    ``image_index`` maps every sample to its row, so a metric encodes an image once for all its captions.

    ``indices`` (the samples' ids), ``image_index``, ``group_ids`` and ``digests`` (an int64 content digest per
    sample, see ``inputs.to_batch``; None: by text) read as int64 tensors; :meth:`host` reads them as numpy."""

    indices = _IndexField()
    image_index = _IndexField()
    group_ids = _IndexField()
    digests = _IndexField()

    def __init__(self, candidates: list[str], indices: Any, images: list[Any] | None = None,
                 image_index: Any = None, references: list[list[str]] | None = None, group_ids: Any = None,
                 digests: Any = None) -> None:
        self.candidates, self.images, self.references = candidates, images, references
        self.indices, self.image_index, self.group_ids, self.digests = indices, image_index, group_ids, digests

    def __repr__(self) -> str:
        return f"Batch({len(self)} samples{', with images' if self.images is not None else ''})"

    def host(self, name: str) -> np.ndarray | None:
        """The field ``name`` (``"indices"``, ``"image_index"``, ``"group_ids"``, ``"digests"``) as int64 numpy,
        or None, without making a tensor."""
        value = getattr(self, "_" + name)
        return None if value is None else host(value).astype(np.int64, copy=False)

    def __len__(self) -> int:
        return len(self.candidates)

    def sample_images(self) -> list[Any]:
        """The image of every sample, in sample order (repeats share one object)."""
        if self.images is None or self.image_index is None:
            raise ValueError("this batch carries no images")
        return [self.images[i] for i in self.host("image_index").tolist()]


@dataclass(frozen=True)
class CorpusSize:
    """What the runner knows of a corpus before any model loads: the number of references of every sample a
    metric will score (after validation and its skips), in scoring order, and how many distinct images and
    reference texts they hold (None where the corpus has none)."""

    reference_counts: tuple[int, ...]
    distinct_images: int | None = None
    distinct_references: int | None = None

    @property
    def samples(self) -> int:
        return len(self.reference_counts)


@dataclass(frozen=True)
class FitProblem:
    """Why a configured metric cannot be fitted on a corpus (see :meth:`Metric.check_corpus`): ``need`` says
    what it needs and what the corpus gives; ``fixes`` are the remedies in words; ``option`` is an option
    (name, example value) that lifts the constraint, if one does."""

    need: str
    fixes: tuple[str, ...] = ()
    option: tuple[str, str] | None = None

    def message(self, metric: str) -> str:
        fixes = list(self.fixes)
        if self.option is not None:
            key, value = self.option
            fixes.append(f"set {key}={value} (`-o {metric}.{key}={value}` on the command line)")
        return f"{metric}: {self.need}" + (f"; {', or '.join(fixes)}" if fixes else "")


@dataclass(frozen=True)
class Requirement:
    """Something a configured metric needs from the machine before it can score (see
    :meth:`Metric.requirements`), checked for every metric of a run by :func:`capeval_plugins.preflight.check`
    before the first sample is scored (or, in a harness, generated), so that a missing piece costs no work:

    * ``"model"``: a checkpoint, ``target`` a hub id or local path (``revision``, ``local_files_only`` as the
      loader will use them): a local folder, or in the Hugging Face cache, or on a reachable hub;
    * ``"java"``: a ``java`` on PATH, for ``target`` (what runs it: ``"METEOR"``);
    * ``"module"``: an importable module ``target`` (an optional extra);
    * ``"file"``: an existing file ``target``;
    * ``"device"``: the device ``target`` on this machine (a GPU index past the last, CUDA where there is none).

    ``why`` names what needs it (``"option model"``); ``remedy`` says what to do when it is missing."""

    kind: Literal["model", "java", "module", "file", "device"]
    target: str
    why: str = ""
    remedy: str = ""
    revision: str | None = None
    local_files_only: bool | None = None


@dataclass
class MetricResult:
    """Corpus score, per-sample scores in input order, and named extras.

    ``extras`` are per-sample (one value or row per sample, same order as ``scores``): a tensor, or a list of
    texts (None where a sample has none, e.g. EXPERT's explanations); ``corpus_extras`` are corpus-level numbers
    (or short strings describing the run, e.g. which features were used). The two never share a key. ``skipped`` maps the index of every sample that was not scored (``on_error="skip"``) to the
    reason; such samples have NaN scores and extras and take no part in the corpus score.
    """

    name: str
    score: float
    scores: Any  # a tensor, or numpy for a metric with host states
    indices: Any
    extras: dict[str, Any] = field(default_factory=dict)
    corpus_extras: dict[str, float | str] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.scores)
        if len(self.indices) != n:
            raise ValueError("indices and scores differ in length")
        for key, value in self.extras.items():
            if len(value) != n:
                raise ValueError(f"extra {key!r} has {len(value)} rows for {n} samples")
        clash = set(self.extras) & set(self.corpus_extras) | {self.name, "scores", "skipped"} & (
            set(self.extras) | set(self.corpus_extras)
        )
        if clash:
            raise ValueError(f"result keys used twice: {sorted(clash)}")

    def __len__(self) -> int:
        return len(self.scores)

    def with_skipped(self, skipped: Mapping[int, str]) -> "MetricResult":
        """This result with the ``skipped`` samples put back in index order (NaN score and extras) and
        counted in ``corpus_extras["n_skipped"]``."""
        if not skipped:
            return self
        missing = np.array(sorted(skipped), dtype=np.int64)
        indices = np.concatenate([host(self.indices).astype(np.int64), missing])
        order = np.argsort(indices, kind="stable")

        def padded(values: Any) -> Any:
            if isinstance(values, list):  # texts: None for the skipped samples
                kept = values + [None] * len(missing)
                return [kept[k] for k in order.tolist()]
            if is_tensor(values):
                import torch

                values = values.cpu()
                if not values.is_floating_point():
                    values = values.to(torch.float64)
                blank = torch.full((len(missing), *values.shape[1:]), math.nan, dtype=values.dtype)
                return torch.cat([values, blank])[torch.from_numpy(order)]
            values = np.asarray(values)
            if not np.issubdtype(values.dtype, np.floating):
                values = values.astype(np.float64)
            return np.concatenate([values, np.full((len(missing), *values.shape[1:]), math.nan, values.dtype)])[order]

        return dataclasses.replace(
            self,
            scores=padded(self.scores),
            indices=same_kind(indices[order], self.indices),
            extras={k: padded(v) for k, v in self.extras.items()},
            corpus_extras={**self.corpus_extras, "n_skipped": float(len(skipped))},
            skipped={**self.skipped, **{int(i): r for i, r in skipped.items()}},
        )

    def to_dict(self) -> dict[str, Any]:
        """The shape scripts rely on: ``{name: corpus, "scores": [...], **extras, **corpus_extras}`` (and
        ``"skipped": {index: reason}`` when samples were skipped)."""
        out: dict[str, Any] = {self.name: self.score, "scores": self.scores.tolist()}
        out.update({k: extra_values(v) for k, v in self.extras.items()})
        out.update(self.corpus_extras)
        if self.skipped:
            out["skipped"] = dict(self.skipped)
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One record per sample, in input order: ``index``, ``score``, the per-sample extras, and ``error``
        (the reason) for a skipped sample."""
        columns = {k: extra_values(v) for k, v in self.extras.items()}
        rows = []
        for j, (i, s) in enumerate(zip(self.indices.tolist(), self.scores.tolist())):
            row = {"index": int(i), "score": float(s), **{k: col[j] for k, col in columns.items()}}
            if int(i) in self.skipped:
                row["error"] = self.skipped[int(i)]
            rows.append(row)
        return rows


def extra_values(values: Any) -> list:
    """A per-sample extra as a list (one value, row or text per sample)."""
    return list(values) if isinstance(values, list) else values.tolist()


ON_ERROR = ("raise", "skip")


@dataclass
class MetricConfig:
    """Options every metric shares. A metric's own ``Config`` subclasses this; its field defaults are the
    paper's configuration.

    ``on_error``: what a sample that cannot be scored (missing or corrupt image, missing references, text no
    tokenizer takes; an empty caption is an answer and is scored) does: ``"raise"`` stops before anything is
    scored, naming every such sample; ``"skip"`` scores the others and records the skipped ones, with their
    reason, in the result."""

    batch_size: int = 64
    on_error: str = "raise"

    # Options that name existing files or folders to read (checked before anything is scored).
    input_paths: ClassVar[tuple[str, ...]] = ()


@dataclass
class ModelConfig(MetricConfig):
    """Options of metrics that load a model through :mod:`capeval_plugins.resources.loading`.

    ``device_map`` (``"auto"`` or a module -> device mapping), ``max_memory`` (device -> size) and
    ``offload_folder`` spread a model over several devices or offload part of it to CPU memory or disk
    (accelerate); ``device`` is then where inputs start and outputs are gathered."""

    model: str = ""
    device: str | None = None
    dtype: str | None = None
    revision: str | None = None
    local_files_only: bool | None = None
    trust_remote_code: bool = False
    device_map: str | dict | None = None
    max_memory: dict | None = None
    offload_folder: str | None = None

    input_paths: ClassVar[tuple[str, ...]] = ("model",)
    # Options that name a checkpoint (hub id or local path) loaded with ``revision`` and ``local_files_only``:
    # each is a ``"model"`` requirement (see Metric.requirements).
    model_options: ClassVar[tuple[str, ...]] = ("model",)


class Metric(abc.ABC):
    """Base class of every metric. Subclasses set ``info`` and ``Config`` and implement ``states``,
    ``map`` and ``finalize``. Instances are stateless (config and a shared backbone), so one instance may
    serve several adapters at once; the accumulated state lives in the caller."""

    info: ClassVar[MetricInfo]
    Config: ClassVar[type[MetricConfig]] = MetricConfig
    # Extras that repeat the per-sample score by definition (BERTScore's ``f1``, kept under the name other
    # ecosystems give it): score tables leave them out. Declared, never guessed from the values, so that a
    # table's columns do not depend on the data (precision = recall = F1 on a caption equal to its reference).
    score_aliases: ClassVar[tuple[str, ...]] = ()
    # Host contract states (numpy index, group and digest) for a metric whose states are all text states: a
    # metric that declares a numpy dtype gets them by that alone (:func:`host_metric`); one whose states are
    # texts only gets them when it says so, as the classic metrics do, for its finalize may read them as tensors.
    host_contract: ClassVar[bool] = False

    def __init__(self, **config: Any) -> None:
        self.config = build_config(self.Config, config, self.info.name)

    def __deepcopy__(self, memo: dict) -> "Metric":
        # Stateless and possibly holding a large backbone: copies (torchmetrics clone(), deepcopy of a
        # LightningModule) share it.
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    @abc.abstractmethod
    def states(self) -> dict[str, StateSpec]:
        """The state tensors ``map`` returns and how each merges."""

    @abc.abstractmethod
    def map(self, batch: Batch) -> dict[str, Tensor]:
        """Per-sample rows or partial sums for one batch."""

    @abc.abstractmethod
    def finalize(self, state: dict[str, Tensor]) -> MetricResult:
        """Merged state (rows sorted by sample index, repeats removed) -> result."""

    def prepare_corpus(self, corpus: Batch) -> None:
        """Optional whole-corpus preparation: the runner calls it once before its pass, with every sample of
        the pass (text only: ``images`` is None; on a resumed run the samples already mapped too, so that what
        is prepared, and every score, does not depend on where the run was interrupted), and
        :meth:`release_corpus` after it. A metric may cache work shared across batches here (e.g. embed each
        distinct text once); ``map`` must give the same result with or without it (a streaming adapter, e.g.
        torchmetrics' ``update``, prepares each update's batch alone), unless :meth:`whole_corpus_only` says
        otherwise. Default: nothing."""

    def release_corpus(self) -> None:
        """Drop what :meth:`prepare_corpus` kept. Default: nothing."""

    def whole_corpus_only(self) -> str | None:
        """Why this configured metric's scores depend on preparing the whole corpus in one pass (then an adapter
        that streams batches refuses it with this line, rather than score each batch as a corpus of its own);
        None when a batch prepared alone scores the same. Default: None."""
        return None

    def seeded_by_ids(self) -> str | None:
        """Why this configured metric's scores depend on the values of the sample ids (a draw seeded by a sample's
        index, as an official script's loop index), or None (the default): an adapter whose made-up ids change with
        its history (torchmetrics' ``update`` without ``ids``) then refuses to make them up."""
        return None

    def default_sources(self) -> dict[str, str]:
        """What an unset option of ``Config.input_paths`` resolves to, by option name: the default folder in the
        user's cache that a metric with a ``checkpoint()`` (PAC-S, Polos, VELA, EXPERT) loads when ``model`` is
        empty. Resume and the bench score cache key on these by content, as on the options set."""
        checkpoint = getattr(self, "checkpoint", None)
        if callable(checkpoint) and not getattr(self.config, "model", None):
            return {"model": checkpoint()}
        return {}

    def image_reader(self) -> Any:
        """How this metric reads its images: ``None`` for pixel images (paths, PIL, arrays, videos), or an
        :class:`~capeval_plugins.inputs.ImageReader` for another form (e.g. ids of precomputed features)."""
        return None

    def requirements(self) -> list[Requirement]:
        """What this configured metric needs from the machine (models, Java, optional modules, files), checked
        before any work by every entry point (:mod:`capeval_plugins.preflight`); it must not load anything.
        Default: each option of ``Config.model_options`` that is set, and accelerate for a ``device_map``."""
        cfg = self.config
        named = {key: getattr(cfg, key, None) for key in getattr(cfg, "model_options", ())}
        needs = [Requirement("model", value, f"option {key}", revision=getattr(cfg, "revision", None),
                             local_files_only=getattr(cfg, "local_files_only", None))
                 for key, value in named.items() if isinstance(value, str) and value]
        if getattr(cfg, "device_map", None) is not None:
            needs.append(Requirement("module", "accelerate", "option device_map", install_extra("accelerate")))
        if isinstance(getattr(cfg, "device", None), str):
            needs.append(Requirement("device", cfg.device, "option device"))
        return needs

    def check_corpus(self, size: CorpusSize) -> FitProblem | None:
        """Why this configured metric cannot be fitted on a corpus of ``size`` (None when it can): a corpus
        statistic that needs more samples than it will get (a covariance needing more pairs than dimensions).
        The runner calls it after validation and before any model loads, so it must not load one (reading
        a model's config file is fine); a usage error found here costs the user no wait."""
        return None

    def uses_references(self) -> bool:
        """Whether this configured metric reads references: entry points pass them only to a metric that does
        (``info.references`` says what the method may use; an instance can leave them aside, e.g. CLIPScore
        without its RefCLIPScore extras, so that they cost nothing)."""
        return self.info.references != "never"

    def unused_references_hint(self) -> str:
        """What a user who passed references to this configured metric, which leaves them aside, can do instead
        (shown when they are dropped). Default: nothing."""
        return ""

    @classmethod
    def tiny_recipe(cls) -> dict[str, Any] | None:
        """Options that build this metric on tiny offline models in seconds on a CPU (e.g. a checkpoint from
        :func:`capeval_plugins.testing.tiny_checkpoint`), for tests: the metric test kit
        (:mod:`capeval_plugins.testing.kit`) builds a class with them, and the package's own suite runs its
        per-metric tests on a third-party metric installed beside it with them. ``None`` (the default): no
        recipe; the suite then skips that metric's per-metric tests, saying so. The package's own metrics keep
        theirs in its test suite (docs/adding-a-metric.md)."""
        return None

    def references_required(self) -> bool:
        """Whether this configured metric cannot score without references (``info.references`` says what the
        method may use; an instance can need them where the method does not always, e.g. MID without a
        saved fit)."""
        return self.info.references == "always"

    def blank_references_allowed(self) -> bool:
        """Whether a blank reference is text this configured metric scores rather than a missing reference, which
        is refused by its sample: e.g. a classic metric given PTB tokens, where a blank one is what the tokenizer
        made of "..." and pycocoevalcap scores it. Default: refused."""
        return False

    def __call__(
        self,
        images: Sequence[Any] | None = None,
        candidates: Sequence[str] | None = None,
        references: Sequence[Any] | None = None,
        *,
        group_ids: Sequence[Any] | None = None,
        ids: Sequence[int] | None = None,
        on_error: str | None = None,
        run_dir: str | None = None,
        restart: bool = False,
        progress: bool = False,
    ) -> MetricResult:
        """Score a whole corpus in this process: :func:`capeval_plugins.score`, i.e. the runner's session
        (validate everything first, errors naming ``ids[i]``, else the position; check the corpus fits; batch,
        candidates of one image together; map, merge, finalize; checkpoint in ``run_dir``). It does not shard
        over torch.distributed ranks (a call made on one rank only must not wait for the others):
        ``runner.score(..., shard=True)`` does.

        The contract does not import the runner (the runner stands on the contract): the call is wired at the
        top, in the package's own ``score``, which imports the runner when it is first used."""
        import capeval_plugins

        return capeval_plugins.score(self, images, candidates, references, group_ids=group_ids, ids=ids,
                                     on_error=on_error, run_dir=run_dir, restart=restart, progress=progress)


def build_config(config_cls: type[MetricConfig], values: Mapping[str, Any], name: str) -> MetricConfig:
    """Instantiate a metric's Config, refusing unknown keys with the list of valid ones, and values of the
    wrong type, not finite or outside their :func:`~capeval_plugins.core.bounds.bounded` range with the option's
    name."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"{name}: unknown option(s) {unknown}; valid options: {sorted(known)}")
    config = config_cls(**values)
    if config.on_error not in ON_ERROR:
        raise ValueError(f"{name}: on_error must be one of {ON_ERROR}, got {config.on_error!r}")
    if isinstance(config.batch_size, bool) or not isinstance(config.batch_size, int) or config.batch_size < 1:
        raise ValueError(f"{name}: batch_size must be a positive integer, got {config.batch_size!r}")
    for option in known:  # types and ranges (core.bounds): the same for every entry point
        problem = field_problem(config, option)
        if problem:
            raise ValueError(f"{name}: option {option} {problem}")
    if isinstance(config, ModelConfig):  # a dtype or device no machine has: refused before anything loads
        from capeval_plugins.resources.loading import placement_problem

        problem = placement_problem(config.device, config.dtype, config.device_map, config.max_memory,
                                    config.offload_folder)
        if problem:
            raise ValueError(f"{name}: {problem}")
    return config


def full_spec(metric: Metric) -> dict[str, StateSpec]:
    """The metric's states plus the contract's own index and group rows."""
    spec = dict(metric.states())
    for reserved in CONTRACT_STATES:
        if reserved in spec:
            raise ValueError(f"{metric.info.name}: state name {reserved!r} is reserved")
    int64 = np.int64 if host_metric(metric) else None
    for reserved in CONTRACT_STATES:
        spec[reserved] = StateSpec("cat", int64) if int64 else _torch_int64()
    return spec


def host_metric(metric: Metric) -> bool:
    """Whether the contract's states of ``metric`` are host states (its finalize then sees numpy only, and its run
    needs no torch): its own states are all host states, and one of them is declared with a numpy dtype (not a
    text state, host whatever was written) or the metric sets ``host_contract``."""
    states = metric.states()
    return bool(states) and all(spec.host for spec in states.values()) and (
        type(metric).host_contract or any(not spec.text for spec in states.values()))


def _torch_int64() -> StateSpec:
    import torch

    return StateSpec("cat", torch.int64)


def map_batch(metric: Metric, batch: Batch) -> dict[str, Tensor]:
    """Run ``metric.map`` and check what it returned against its declared states, so a metric that drops
    or reorders a sample fails here instead of silently misaligning scores."""
    spec = metric.states()
    out = metric.map(batch)
    if set(out) != set(spec):
        raise RuntimeError(f"{metric.info.name}.map returned {sorted(out)}, declared {sorted(spec)}")
    n = len(batch)
    checked: dict[str, Any] = {}
    for key, value in out.items():
        want = spec[key]
        if want.text and isinstance(value, PackedTexts):
            if len(value) != n or value.data.dtype != np.uint8:
                raise RuntimeError(f"{metric.info.name}.map: state {key!r} packs {len(value)} texts for {n} samples")
            checked[key] = value
            continue
        expected = (n, *want.shape) if want.reduce == "cat" else want.shape
        got = tuple(value.shape)
        if want.ragged and len(got) == len(expected):
            got = tuple(-1 if e == -1 else g for g, e in zip(got, expected))
        if got != tuple(expected):
            raise RuntimeError(f"{metric.info.name}.map: state {key!r} has shape {tuple(value.shape)}, expected {expected}")
        checked[key] = host(value).astype(want.dtype, copy=False) if want.host else \
            as_tensor(value).detach().to(want.dtype)
    groups, digests = batch.host("group_ids"), batch.host("digests")
    rows = {INDEX: batch.host("indices"), GROUP: groups if groups is not None else np.full(n, -1, np.int64),
            DIGEST: digests if digests is not None and len(digests) == n else text_digests(batch)}
    host_rows = host_metric(metric)
    checked.update({k: v if host_rows else as_tensor(v) for k, v in rows.items()})
    return checked


def content_digest(*parts: Any) -> int:
    """A non-negative 63-bit digest of ``parts`` (text, or bytes): the same sample gives the same digest in
    every batch, process and machine."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode()
        h.update(len(data).to_bytes(8, "big") + data)
    return int.from_bytes(h.digest(), "big") >> 1


def text_digests(batch: Batch, images: Sequence[bytes] | None = None) -> np.ndarray:
    """Per sample (int64): the digest of its caption, references and (``images``, one identity per distinct
    image of the batch) its image."""
    index = batch.host("image_index")
    index = index.tolist() if index is not None else None
    refs = batch.references
    return np.array([content_digest(c, refs[i] if refs is not None else None,
                                    images[index[i]] if images is not None and index is not None else b"")
                     for i, c in enumerate(batch.candidates)], dtype=np.int64).reshape(-1)


def merge_states(spec: Mapping[str, StateSpec], parts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The reduce step, the only one: concatenate ``"cat"`` rows in the order of ``parts``, add ``"sum"``
    statistics in that order. Batches of a stream, the pieces of one batch, a rank's batches and its running
    sums, the ranks of a run: every merge is this function, so they all give the same bits.

    A part may hold some of the states only (a batch's rows without the running sums, the sums alone); a state
    no part holds is empty. ``parts`` is consumed once (it may be a generator): ``"sum"`` states are added as
    they arrive, so a corpus statistic costs one accumulator however many parts there are."""
    rows: dict[str, list[Any]] = {k: [] for k, want in spec.items() if want.reduce == "cat"}
    sums: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key in rows:
                rows[key].append(value)
            elif key in spec:
                sums[key] = _added(sums.get(key), value)
            else:
                raise KeyError(f"state {key!r} is not declared (declared: {sorted(spec)})")
    merged: dict[str, Any] = {}
    for key, want in spec.items():
        value = want.cat(rows[key]) if key in rows else sums.get(key)
        if value is None:
            value = want.empty()
        elif key in sums:  # as this state's kind (a checkpoint's sums are read back as arrays where they can be)
            value = host(value) if want.host else as_tensor(value)
        merged[key] = value
    return merged


def _added(total: Any, value: Any) -> Any:
    """``total + value`` into ``total`` (a copy of ``value`` when there is no total yet)."""
    if total is None:  # a copy: the running total must not be the batch's own array
        return value.clone() if is_tensor(value) else np.array(value, copy=True)
    if is_tensor(total):
        return total.add_(as_tensor(value, total))
    np.add(total, host(value), out=total)
    return total


def canonical_state(spec: Mapping[str, StateSpec], state: Mapping[str, Tensor],
                    allowed_repeats: int | None = None) -> tuple[dict[str, Tensor], int]:
    """Sort ``"cat"`` rows by sample index and drop repeated indices (keeping the first).

    Returns the state and the number of dropped repeats. A repeat must be the same sample (its content
    digest, :data:`DIGEST`, equal to the first's), and with ``allowed_repeats`` there may be at most that many
    (a padding ``DistributedSampler`` adds at most ``world_size - 1``); otherwise the ids name different
    samples, and :class:`RepeatedSamples` names them. ``"sum"`` states cannot be de-duplicated; a caller
    that dropped repeats warns when the metric has any.
    """
    index = host(state[INDEX]).reshape(-1)
    order = np.argsort(index, kind="stable")
    sorted_index = index[order]
    keep = np.ones(len(sorted_index), dtype=bool)
    keep[1:] = sorted_index[1:] != sorted_index[:-1]
    repeats = int((~keep).sum())
    if repeats:
        _check_repeats(state, order, sorted_index, keep, repeats, allowed_repeats)
    rows = order[keep]
    out = {}
    for key, want in spec.items():
        value = state[key]
        if want.reduce == "cat" and isinstance(value, PackedTexts):
            value = value.select(rows)
        elif want.reduce == "cat":
            value = value if want.ragged else value.reshape(-1, *want.shape)
            value = take(value, rows)
        out[key] = value
    return out, repeats


class RepeatedSamples(DataError):
    """One sample id given for different samples, or more repeats than a padding sampler makes."""


def _check_repeats(state: Mapping[str, Any], order: np.ndarray, sorted_index: np.ndarray, keep: np.ndarray,
                   repeats: int, allowed: int | None) -> None:
    def shown(ids: np.ndarray) -> str:
        ids = np.unique(ids).tolist()
        return ", ".join(map(str, ids[:10])) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")

    if allowed is not None and repeats > allowed:
        raise RepeatedSamples(
            f"{repeats} samples were given more than once (ids {shown(sorted_index[~keep])}), but a padding "
            f"DistributedSampler repeats at most world_size - 1 = {allowed}: ids must be unique across processes "
            "(pass each sample's dataset index, not its position in the shard)")
    if DIGEST in state:
        digest = host(state[DIGEST]).reshape(-1)[order]
        first = digest[keep][np.cumsum(keep, dtype=np.int64) - 1]  # the kept row's digest, for every row
        differ = digest != first
        if bool(differ.any()):
            raise RepeatedSamples(
                f"sample id(s) {shown(sorted_index[differ])} were given for different samples (other caption, "
                "references or image): ids must name one sample each, e.g. its dataset index (a "
                "DistributedSampler's padding repeats the same sample)")


def finalize_state(metric: Metric, state: Mapping[str, Tensor], allowed_repeats: int | None = None) -> MetricResult:
    spec = full_spec(metric)
    ordered, repeats = canonical_state(spec, state, allowed_repeats)
    if repeats and any(s.reduce == "sum" for s in metric.states().values()):
        # a sum cannot give back one sample's part: the number would count the repeats (MID's fit moved by 3.2
        # per sample on 40 samples over 3 ranks), so none is given
        raise RepeatedSamples(
            f"{metric.info.name}: {repeats} sample(s) came twice (a DistributedSampler's padding repeats samples "
            "to even the ranks); their per-sample rows can be dropped, but this metric's summed statistics "
            "count them: use a sampler that does not repeat samples (drop_last=True, or an even split)")
    result = metric.finalize(ordered)
    if repeats:  # a padding DistributedSampler's repeats: dropped, and said so
        result = dataclasses.replace(result, corpus_extras={**result.corpus_extras, "n_repeats_dropped": float(repeats)})
    return result


class PointwiseMetric(Metric):
    """A metric whose score is a per-sample number and whose corpus score is the mean.

    Subclasses name their per-sample ``extra_names`` and implement ``score`` returning
    ``{"score": (B,), <extra>: (B, ...), ...}``. Samples whose score is NaN (an explicit per-sample policy,
    e.g. an LVLM that wrote no number) are left out of the mean and counted in ``n_invalid``.
    ``optional_extras`` may be NaN where an input was not given (e.g. a reference-based extra without
    references) and are dropped when NaN for every sample; ``mean_extras`` also get their corpus mean as
    ``mean_<name>``. ``reports_invalid``: a metric whose samples can be invalid by its own policy (an LVLM
    judge) always reports ``n_invalid`` (0 when none), so its result keys do not depend on the data."""

    reports_invalid: ClassVar[bool] = False
    extra_names: ClassVar[tuple[str, ...]] = ()
    extra_shapes: ClassVar[Mapping[str, tuple[int, ...]]] = {}
    optional_extras: ClassVar[tuple[str, ...]] = ()
    mean_extras: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def score(self, batch: Batch) -> dict[str, Tensor]:
        """``{"score": (B,), **extras}`` for one batch."""

    def states(self) -> dict[str, StateSpec]:
        names = ("score", *self.extra_names)
        return {k: StateSpec("cat", shape=tuple(self.extra_shapes.get(k, ()))) for k in names}  # torch.float64

    def map(self, batch: Batch) -> dict[str, Tensor]:
        return self.score(batch)

    def corpus_extras(self, state: Mapping[str, Tensor]) -> dict[str, float]:
        """Corpus-level extras beyond ``mean_<extra>`` (default: none)."""
        return {}

    def finalize(self, state: dict[str, Tensor]) -> MetricResult:
        scores = state["score"]
        n_invalid = int(np.isnan(host(scores)).sum())
        extras = {
            k: state[k]
            for k in self.extra_names
            if k not in self.optional_extras or not bool(np.isnan(host(state[k])).all())
        }
        corpus = {f"mean_{k}": nanmean(extras[k]) for k in self.mean_extras if k in extras}
        corpus.update(self.corpus_extras(state))
        if n_invalid or self.reports_invalid:
            corpus["n_invalid"] = float(n_invalid)
        return MetricResult(
            name=self.info.name,
            score=nanmean(scores),
            scores=scores,
            indices=state[INDEX],
            extras=extras,
            corpus_extras=corpus,
        )


COMPONENT_SEP = "__"


class CompositeMetric(Metric):
    """A metric built from named component metrics (e.g. a fusion of a corpus metric and pointwise ones).

    Its states are the components' states side by side, named ``<component>__<state>``, so each keeps its
    own reduce (``"sum"`` statistics stay sums); ``map`` runs every component's map on the batch; at
    finalize every component finalizes its own states and ``combine`` turns their results (all in the same
    sample order) into one. Subclasses implement ``components`` (built once; cache them) and ``combine``."""

    @abc.abstractmethod
    def components(self) -> Mapping[str, Metric]:
        """The component metrics by name (identifiers without ``__``)."""

    @abc.abstractmethod
    def combine(self, results: Mapping[str, MetricResult], state: Mapping[str, Tensor]) -> MetricResult:
        """One result from the components' results (each in sample-index order)."""

    def states(self) -> dict[str, StateSpec]:
        spec = {}
        for name, metric in self.components().items():
            if not name.isidentifier() or COMPONENT_SEP in name:
                raise ValueError(f"{self.info.name}: component name {name!r} must be an identifier without '__'")
            spec.update({f"{name}{COMPONENT_SEP}{key}": s for key, s in metric.states().items()})
        return spec

    def map(self, batch: Batch) -> dict[str, Tensor]:
        out = {}
        for name, metric in self.components().items():
            for key, value in map_batch(metric, batch).items():
                if key not in CONTRACT_STATES:
                    out[f"{name}{COMPONENT_SEP}{key}"] = value
        return out

    def requirements(self) -> list[Requirement]:
        return list(dict.fromkeys(r for metric in self.components().values() for r in metric.requirements()))

    def check_corpus(self, size: CorpusSize) -> FitProblem | None:
        for metric in self.components().values():
            problem = metric.check_corpus(size)
            if problem is not None:
                return problem
        return None

    def prepare_corpus(self, corpus: Batch) -> None:
        for metric in self.components().values():
            metric.prepare_corpus(corpus)

    def release_corpus(self) -> None:
        for metric in self.components().values():
            metric.release_corpus()

    def component_state(self, name: str, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The part of a (canonical) composite state that belongs to one component, with index and groups."""
        component = self.components()[name]
        own = {key: state[f"{name}{COMPONENT_SEP}{key}"] for key in component.states()}
        kind = host if host_metric(component) else as_tensor  # the contract states its finalize expects
        return {**own, **{key: kind(state[key]) for key in CONTRACT_STATES if key in state}}

    def finalize(self, state: dict[str, Tensor]) -> MetricResult:
        # each component's result as the composite's kind (a host component, e.g. CIDEr, beside a torch one gets
        # tensor contract states here and gives numpy scores: combine sees one kind)
        results = {name: _results_kind(metric.finalize(self.component_state(name, state)), state[INDEX])
                   for name, metric in self.components().items()}
        for name, result in results.items():
            if not np.array_equal(host(result.indices), host(state[INDEX])):
                raise RuntimeError(f"{self.info.name}: component {name!r} reordered or dropped samples")
        return self.combine(results, state)


def _results_kind(result: MetricResult, like: Any) -> MetricResult:
    """``result`` with its scores, indices and array extras as the kind of ``like`` (numpy or a tensor)."""
    return dataclasses.replace(result, scores=kind_of(result.scores, like), indices=kind_of(result.indices, like),
                               extras={k: v if isinstance(v, list) else kind_of(v, like) for k, v in result.extras.items()})


def nanmean(values: Any) -> float:
    if not is_tensor(values):
        valid = np.asarray(values)[~np.isnan(values)]
        return float(valid.mean()) if len(valid) else math.nan
    import torch

    valid = values[~torch.isnan(values)]
    return float(valid.mean()) if len(valid) else math.nan
