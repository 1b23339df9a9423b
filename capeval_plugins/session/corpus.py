"""A corpus as the caller gives it, and what the session checks of it before any work: every metric's valid
samples and the ones it skips (:func:`validate`), the size of what it will score (:func:`corpus_size`, the rows a
stream keeps to learn it: :data:`SIZE_SPEC`) and the local files its options name (:func:`check_paths`)."""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from capeval_plugins.core.arrays import host, is_tensor
from capeval_plugins.contract import ON_ERROR, CorpusSize, Metric, StateSpec, content_digest
from capeval_plugins.digests import ContentDigests
from capeval_plugins.inputs import InputError, ProblemReport, Samples, validate_samples

Describe = Callable[[int], str]


@dataclass
class Corpus:
    """A corpus as given: parallel lists, the ids that name its samples (default: positions) and how an
    error describes a sample (default ``"sample <id>"``; the CLI adds the caption file's line)."""

    candidates: Sequence[Any] | None
    images: Sequence[Any] | None = None
    references: Sequence[Any] | None = None
    group_ids: Sequence[Any] | None = None
    ids: Sequence[int] | None = None
    describe: Describe | None = None

    def name(self, index: int) -> str:
        return self.describe(index) if self.describe else f"sample {index}"

    def digest(self, contents: ContentDigests | None = None) -> str:
        """A fingerprint of the inputs (captions, references, groups, ids, and each image by its content:
        a file's bytes, given bytes or pixels), for checkpoints."""
        contents = contents if contents is not None else ContentDigests()
        h = hashlib.sha256()
        n = len(self.candidates) if self.candidates is not None else 0
        texts = [self.candidates, self.references, self.group_ids, self.ids]
        for i in range(n):
            row = [None if c is None else _plain(c[i]) for c in texts]
            row.append(None if self.images is None else _image_token(self.images[i], contents))
            h.update(json.dumps(row, sort_keys=True, default=str).encode())
        return h.hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray) or is_tensor(value):
        return value.tolist()
    return value


def _image_token(value: Any, contents: ContentDigests) -> Any:
    """A JSON-able identity of one image as given, by content: a file by its path and bytes (hashed once per
    run), given bytes and pixels by their hash."""
    from PIL import Image

    if isinstance(value, (str, os.PathLike)):
        return contents.file(value)
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", hashlib.sha1(value).hexdigest()]
    if isinstance(value, Image.Image):
        return ["pil", value.mode, value.size, hashlib.sha1(value.tobytes()).hexdigest()]
    if isinstance(value, np.ndarray) or is_tensor(value):
        arr = value.detach().cpu().numpy() if is_tensor(value) else value
        return ["array", str(arr.dtype), list(arr.shape), hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest()]
    if isinstance(value, dict):
        return {k: _image_token(v, contents) if k != "bytes" or v else None for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_image_token(v, contents) for v in value]
    return repr(value)


def policy(metric: Metric, on_error: str | None = None) -> str:
    how = on_error if on_error is not None else metric.config.on_error
    if how not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {how!r}")
    return how


def validate(metric: Metric, corpus: Corpus, on_error: str | None = None,
             checked: dict | None = None) -> tuple[Samples, dict[int, str]]:
    """The samples ``metric`` can score and the ones it skips (``{index: reason}``); with ``on_error="raise"``
    any problem raises one :class:`InputError` naming every bad sample (the first 20, then a count)."""
    samples, problems = _check(metric, corpus, checked)
    if problems and policy(metric, on_error) == "raise":
        raise problems.error(corpus.describe)
    return samples, problems.reasons()


def _check(metric: Metric, corpus: Corpus, checked: dict | None,
           shared: bool = False) -> tuple[Samples, ProblemReport]:
    """``shared``: the corpus serves several metrics, so inputs this one never uses are not its concern."""
    references = corpus.references
    if references is not None and not metric.uses_references():
        if metric.info.references != "never":  # the method could read them, this configuration does not
            if not shared:
                warnings.warn(f"{metric.info.name} does not use references as configured; they are ignored"
                              f"{metric.unused_references_hint()}", stacklevel=5)
            references = None
        elif shared:
            references = None
    return validate_samples(metric.info, corpus.images, corpus.candidates, references, corpus.group_ids,
                            corpus.ids, reader=metric.image_reader(), references_required=metric.references_required(),
                            blank_references=metric.blank_references_allowed(), checked=checked)


def corpus_size(samples: Samples) -> CorpusSize:
    """What :meth:`~capeval_plugins.contract.Metric.check_corpus` sees of the samples a metric will score."""
    refs = samples.references
    counts = tuple(len(r) for r in refs) if refs is not None else (0,) * len(samples)
    images = len({s.key for s in samples.images}) if samples.images is not None else None
    texts = len({r for group in refs for r in group}) if refs is not None else None
    return CorpusSize(counts, images, texts)


# What a stream (the torchmetrics adapter) keeps to check a corpus it learns batch by batch: per sample its id
# (to drop a padding sampler's repeats), its number of references, a digest of its image and of each reference
# text (zero-padded: digests are odd, never 0). Kept only for metrics that check their corpus; host states.
SIZE_SPEC = {"_size_index": StateSpec("cat", np.int64), "_size_references": StateSpec("cat", np.int64),
             "_size_image": StateSpec("cat", np.int64), "_size_texts": StateSpec("cat", np.int64, (-1,))}


def checks_corpus(metric: Metric) -> bool:
    return type(metric).check_corpus is not Metric.check_corpus


def size_rows(samples: Samples) -> dict[str, np.ndarray]:
    """The :data:`SIZE_SPEC` rows of ``samples``. An image is known by its key, as :func:`corpus_size` counts
    it (a file by its path, an in-memory image by its object)."""
    n, refs = len(samples), samples.references
    odd = lambda *parts: content_digest(*parts) | 1  # noqa: E731
    images = [odd(repr(s.key)) for s in samples.images] if samples.images is not None else [0] * n
    texts = [[odd(r) for r in group] for group in refs] if refs is not None else [[] for _ in range(n)]
    width = max((len(t) for t in texts), default=0)
    return {"_size_index": np.array(samples.indices, dtype=np.int64).reshape(n),
            "_size_references": np.array([len(t) for t in texts], dtype=np.int64).reshape(n),
            "_size_image": np.array(images, dtype=np.int64).reshape(n),
            "_size_texts": np.array([t + [0] * (width - len(t)) for t in texts], dtype=np.int64).reshape(n, width)}


def size_of_rows(state: Mapping[str, Any]) -> CorpusSize:
    """The :class:`CorpusSize` of merged :data:`SIZE_SPEC` rows (arrays or tensors), each sample id counted
    once."""
    index = host(state["_size_index"]).reshape(-1)
    order = np.argsort(index, kind="stable")
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = index[order][1:] != index[order][:-1]
    rows = order[keep]
    counts = host(state["_size_references"])[rows]
    images = host(state["_size_image"])[rows]
    texts = host(state["_size_texts"])[rows]
    has_refs = bool(counts.any())
    return CorpusSize(tuple(counts.tolist()), len(np.unique(images)) if bool(images.any()) else None,
                      len(np.unique(texts[texts != 0])) if has_refs else None)


def check_paths(metric: Metric) -> None:
    """Options that name local files or folders (``Config.input_paths``) must exist: a typo fails here, not
    after a long load. Hub ids (``org/name``) are left to the loader."""
    for key in getattr(metric.config, "input_paths", ()):
        value = getattr(metric.config, key, None)
        if not (isinstance(value, str) and value):
            continue
        from capeval_plugins.resources.loading import local_path_problem  # (torch: only for a path to check)

        problem = local_path_problem(value)
        if problem:
            raise InputError(f"{metric.info.name}: option {key}: {problem}")


