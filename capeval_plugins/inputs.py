"""Turning user input into validated batches, in one place.

Images may be PIL images, file paths, ``{"bytes"|"path": ...}`` dicts (the ``datasets.Image`` format),
numpy arrays or torch tensors (CHW or HWC, uint8 or float in [0, 1]); a video is a list of such frames.
Captions are strings; references a list of strings per sample (a single string is one reference).
Every error names the sample index and what is wrong. Image files are checked up front and decoded lazily,
batch by batch, so a corpus of paths never sits decoded in memory.

One image at a time (validating it without decoding, decoding it, its identity) is
:mod:`capeval_plugins.image_sources`, whose names are importable from here too; this module holds what works on
a whole corpus: :func:`prepare_samples` / :func:`validate_samples` (the list lengths, every caption, reference
list and image, problems reported together), and the batches (:func:`image_batches`, :func:`to_batch`).
"""
from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterable, Mapping, Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from PIL import Image

from capeval_plugins.core.arrays import is_tensor
from capeval_plugins.contract import Batch, MetricInfo, text_digests
# one image at a time; importable from here as before they had a module of their own
from capeval_plugins.image_sources import (SIXTEEN_BIT_MODES, ImageReader, ImageSource, InputError,  # noqa: F401
                                           _in_memory, check_array, image_identity, image_source, mode_problem,
                                           to_rgb)


@dataclass
class Samples:
    """A validated corpus (or shard of one), before batching."""

    candidates: list[str]
    indices: list[int]
    images: list[ImageSource] | None = None
    references: list[list[str]] | None = None
    group_ids: list[int] | None = None

    def __len__(self) -> int:
        return len(self.candidates)

    def subset(self, positions: Sequence[int]) -> "Samples":
        pick = lambda xs: None if xs is None else [xs[p] for p in positions]  # noqa: E731
        return Samples(
            candidates=pick(self.candidates),
            indices=pick(self.indices),
            images=pick(self.images),
            references=pick(self.references),
            group_ids=pick(self.group_ids),
        )


MAX_REPORTED = 20


class ProblemReport:
    """Per-sample problems found by validation, keyed by the sample's own index (the id the user gave, or
    its position in the user's list), in input order."""

    def __init__(self) -> None:
        self.by_index: dict[int, list[str]] = {}

    def add(self, index: int, message: str) -> None:
        messages = self.by_index.setdefault(index, [])
        if message not in messages:
            messages.append(message)

    def merge(self, other: "ProblemReport") -> None:
        for index, messages in other.by_index.items():
            for message in messages:
                self.add(index, message)

    def __len__(self) -> int:
        return len(self.by_index)

    def reasons(self) -> dict[int, str]:
        """``{index: "problem; other problem"}``."""
        return {i: "; ".join(m) for i, m in self.by_index.items()}

    def error(self, describe: Callable[[int], str] | None = None) -> "InputError":
        """One error listing the first :data:`MAX_REPORTED` problems, then how many more there are."""
        describe = describe or (lambda i: f"sample {i}")
        items = sorted(self.by_index.items())
        lines = [f"{describe(i)}: {'; '.join(m)}" for i, m in items[:MAX_REPORTED]]
        if len(items) > MAX_REPORTED:
            lines.append(f"... and {len(items) - MAX_REPORTED} more samples with problems")
        head = "1 sample cannot be scored" if len(items) == 1 else f"{len(items)} samples cannot be scored"
        err = InputError(lines[0] if len(items) == 1 else head + ":\n  " + "\n  ".join(lines))
        err.problems = self.reasons()
        return err


def prepare_samples(
    info: MetricInfo,
    images: Sequence[Any] | None,
    candidates: Sequence[str] | None,
    references: Sequence[Any] | None = None,
    group_ids: Sequence[Any] | None = None,
    indices: Sequence[int] | None = None,
    reader: ImageReader | None = None,
) -> Samples:
    """Validate everything a metric needs and nothing it does not. Raises :class:`InputError` listing every
    sample that cannot be scored (see :func:`validate_samples`)."""
    samples, problems = validate_samples(info, images, candidates, references, group_ids, indices, reader=reader)
    if problems:
        raise problems.error()
    return samples


def validate_samples(
    info: MetricInfo,
    images: Sequence[Any] | None,
    candidates: Sequence[str] | None,
    references: Sequence[Any] | None = None,
    group_ids: Sequence[Any] | None = None,
    indices: Sequence[int] | None = None,
    *,
    reader: ImageReader | None = None,
    references_required: bool | None = None,
    blank_references: bool = False,
    checked: dict | None = None,
) -> tuple[Samples, ProblemReport]:
    """Check every sample and return the valid ones with a report of the others.

    Problems of the input as a whole (no captions, lists of different lengths, references missing for a
    metric that needs them) raise :class:`InputError` at once; problems of one sample (a caption that is not a
    string or holds a NUL, an image file that is missing or whose header does not decode, a bad array, missing
    references; an empty or blank caption is not one: it is an answer, scored) are
    collected by the sample's index, which is ``indices[i]`` when given, else its position. Image files are
    opened only far enough to read their header (once per file, shared through ``checked``); pixels are
    decoded batch by batch. A group metric (``info.groups``) given no ``group_ids`` groups the candidates of
    each image (:func:`image_group_ids`). ``reader`` (from ``Metric.image_reader()``) replaces the
    pixel-image validation and loading; ``references_required`` overrides ``info.references == "always"``;
    ``blank_references``: a blank reference is scored (``Metric.blank_references_allowed``), not refused."""
    cands = _caption_list(candidates)
    n = len(cands)
    ids = check_indices(indices, n)
    problems = ProblemReport()
    found = _once(checked, "captions", (candidates, indices),
                  lambda: [(i, m) for i, c in zip(ids, cands) if (m := caption_problem(c))])
    for i, message in found:
        problems.add(i, message)
    sources = _image_sources(info, images, ids, reader, problems, {} if checked is None else checked)
    refs = _reference_lists(info, references, ids, problems, references_required, checked, indices, blank_references)
    groups = check_group_ids(group_ids, n)
    by_image = [p for p in range(n) if groups is None or groups[p] is None]
    if by_image and info.groups and sources is not None:  # no group given: the candidates of one image
        made = image_group_ids([sources[p] if sources[p] is not None else ImageSource("none", None, ("none", ids[p]),
                                                                                       ids[p]) for p in by_image])
        groups = [None] * n if groups is None else groups
        for p, group in zip(by_image, made):
            groups[p] = group
    elif groups is not None and by_image:
        groups = [-1 if g is None else g for g in groups]
    samples = Samples(candidates=cands, indices=ids, images=sources, references=refs, group_ids=groups)
    if problems:
        bad = problems.by_index
        samples = samples.subset([p for p, i in enumerate(ids) if i not in bad])
    return samples, problems


def _once(checked: dict | None, what: str, inputs: tuple, compute: Callable[[], Any]) -> Any:
    """``compute()`` once for the metrics of a pass: ``checked`` (shared by them) remembers the result for these
    very ``inputs`` objects, so every caption and reference list is checked once per pass, not once per metric."""
    if checked is None:
        return compute()
    entry = checked.get(("once", what))
    if entry is not None and all(a is b for a, b in zip(entry[0], inputs)):
        return entry[1]
    value = compute()
    checked[("once", what)] = (inputs, value)
    return value


def refuse_unordered(value: Any, what: str) -> None:
    """A mapping or a set has no sample order (a dict would give its keys): refuse it rather than misalign."""
    if isinstance(value, (Mapping, AbstractSet)):
        raise InputError(f"{what} must be a sequence in sample order (a list), got {type(value).__name__}")


def _caption_list(candidates: Any) -> list[Any]:
    if candidates is None:
        raise InputError("no candidate captions given")
    if isinstance(candidates, (str, bytes)):
        raise InputError("candidates must be a sequence of strings, got a single string")
    refuse_unordered(candidates, "candidates")
    if isinstance(candidates, np.ndarray):
        candidates = candidates.tolist()
    try:
        return list(candidates)
    except TypeError:
        raise InputError(f"candidates must be a sequence of strings, got {type(candidates).__name__}") from None


def caption_problem(caption: Any) -> str | None:
    """What is wrong with one candidate caption, or None."""
    if caption is None:
        return "caption missing"
    if not isinstance(caption, str):
        return f"caption must be a string, got {type(caption).__name__}"
    return text_problem(caption, "caption")


def text_problem(text: str, what: str) -> str | None:
    """Characters no tokenizer can take: a lone surrogate (valid JSON, not encodable as UTF-8) or a NUL."""
    if "\x00" in text:
        return f"{what} contains a NUL character (U+0000) at character {text.index(chr(0))}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"{what} contains a lone surrogate (U+{ord(text[err.start]):04X}) at character {err.start}, not valid Unicode"
    return None


def check_indices(indices: Sequence[int] | None, n: int) -> list[int]:
    if indices is None:
        return list(range(n))
    values = indices.tolist() if isinstance(indices, np.ndarray) or is_tensor(indices) else list(indices)
    if len(values) != n:
        raise InputError(f"got {len(values)} sample ids for {n} captions")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise InputError(f"sample {i}: sample id must be a non-negative integer, got {v!r}")
    ids = [int(v) for v in values]
    repeated = repeated_ids(ids)
    if repeated:
        raise InputError(f"sample ids must be unique: {describe_repeats(repeated, ids)}")
    return ids


def repeated_ids(ids: Sequence[int], seen: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The ids of ``ids`` that occur twice in it or already in ``seen``, in order of first repeat."""
    found, out = set(seen), []
    for i in ids:
        if i in found and i not in out:
            out.append(i)
        found.add(i)
    return out


def describe_repeats(repeated: Sequence[int], ids: Sequence[int], limit: int = 10) -> str:
    """``"3 at positions 0, 4; 7 at positions 2, 5"`` (the first ``limit`` ids, then a count)."""
    parts = [f"{i} at positions {', '.join(str(p) for p, v in enumerate(ids) if v == i)}" for i in repeated[:limit]]
    more = f"; and {len(repeated) - limit} more" if len(repeated) > limit else ""
    return "; ".join(parts) + more


NAMED_GROUPS = 1 << 62  # group ids that are names, not indices: [2**62, 2**63) (is_name_group)


def is_name_group(group_id: int) -> bool:
    """Whether a checked group id names a group (a name given, or an image) rather than being an index."""
    return group_id >= NAMED_GROUPS


def check_group_ids(group_ids: Sequence[Any] | None, n: int) -> list[int | None] | None:
    """Group ids as ints. An integer id in [0, 2**62) is kept (an index, e.g. a COCO-CF pair's); a negative
    integer means no group (a group of its own, as in ``soft_msd_gate``) and becomes -1; None leaves the sample
    to be grouped by its image (:func:`prepare_samples`); any other id (a string such as an image file name,
    bytes, a tuple of these, a larger integer) is a name, hashed into [2**62, 2**63), so one name gives one group
    in every call, batch and process."""
    if group_ids is None:
        return None
    if isinstance(group_ids, (str, bytes, Mapping)) or getattr(group_ids, "ndim", 1) != 1 or \
            not isinstance(group_ids, Iterable):  # (a dict's keys, or one id, are not one id per sample)
        raise InputError(f"group ids must be a sequence with one id per caption, got {type(group_ids).__name__}")
    values = group_ids.tolist() if isinstance(group_ids, np.ndarray) or is_tensor(group_ids) else list(group_ids)
    if len(values) != n:
        raise InputError(f"got {len(values)} group ids for {n} captions")
    out: list[int | None] = []
    for position, value in enumerate(values):
        if value is None or _integer(value) and value < NAMED_GROUPS:
            out.append(None if value is None else max(int(value), -1))
            continue
        name = _group_name(value)
        if name is None:
            raise InputError(f"group id at position {position} must be an integer, a name (str, bytes, a tuple of "
                             f"these) or None, got {type(value).__name__} {value!r:.60}")
        out.append(_name_id(name))
    return out


def _name_id(name: bytes) -> int:
    return NAMED_GROUPS | _stable_id(name) >> 1


def _integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _group_name(value: Any) -> bytes | None:
    """A name's bytes, the same in every process (tagged by type, so 7 and "7" are two names)."""
    if _integer(value):
        return b"int:%d" % int(value)
    if isinstance(value, str):
        return b"str:" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"bytes:" + value
    if isinstance(value, tuple):
        parts = [_group_name(v) for v in value]
        if None in parts:
            return None
        return b"tuple:" + b"".join(b"%d:%s" % (len(p), p) for p in parts)
    return None


def image_group_ids(sources: Sequence[ImageSource]) -> list[int]:
    """One group per image: a name (:data:`NAMED_GROUPS`), the hash of what makes it the same image in any process
    (:func:`~capeval_plugins.image_sources.image_identity`: a file's resolved path, encoded bytes' hash, an
    in-memory image's pixels). Candidates of one image split across ``update()`` calls or DDP ranks still form
    one group when given in one form each time (a path, encoded bytes, pixels in memory: one file given once as
    a path and once as its bytes is two groups)."""
    found: dict[Any, int] = {}  # an image's candidates share its source: its pixels are hashed once
    return [found[src.key] if src.key in found else found.setdefault(src.key, _name_id(_identity(src)))
            for src in sources]


def _identity(src: ImageSource) -> bytes:
    if src.kind == "video":  # frames are sources of their own
        return b"video:" + b"|".join(_identity(frame) for frame in src.value)
    return image_identity(src.key, src.value)


def _stable_id(identity: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(identity, digest_size=8).digest(), "big") >> 1


def _reference_lists(info: MetricInfo, references: Sequence[Any] | None, ids: list[int], problems: ProblemReport,
                     required: bool | None, checked: dict | None = None,
                     indices: Any = None, blank: bool = False) -> list[list[str]] | None:
    n = len(ids)
    required = info.references == "always" if required is None else required
    if references is None:
        if required:
            raise InputError(f"{info.name} needs references (a list of reference captions per sample)")
        return None
    if info.references == "never":
        warnings.warn(f"{info.name} does not use references; they are ignored", stacklevel=4)
        return None
    if isinstance(references, (str, bytes)):
        raise InputError("references must be a sequence with one entry (a list of strings) per sample")
    refuse_unordered(references, "references")
    given = references
    references = list(references)
    if len(references) != n:
        raise InputError(f"got references for {len(references)} samples but {n} captions")

    def check() -> tuple[list[list[str]], list[tuple[int, str]]]:
        out: list[list[str]] = []
        found = []
        for i, refs in zip(ids, references):
            message = reference_problem(refs, blank)
            if message:
                found.append((i, message))
            out.append([] if message else [refs] if isinstance(refs, str) else [str(r) for r in refs])
        return out, found

    out, found = _once(checked, "references with blanks" if blank else "references", (given, indices), check)
    for i, message in found:
        problems.add(i, message)
    return out


def reference_problem(refs: Any, blank: bool = False) -> str | None:
    """What is wrong with one sample's references (a list of strings, or one string), or None; ``blank``: a
    blank reference is text to score, not a missing one."""
    if refs is None:
        return "references missing"
    if isinstance(refs, str):
        refs = [refs]
    elif isinstance(refs, np.ndarray):
        refs = refs.tolist()
    elif not isinstance(refs, (list, tuple)):
        return f"references must be a list of strings, got {type(refs).__name__}"
    if not refs:
        return "empty list of references"
    for j, ref in enumerate(refs):
        if not isinstance(ref, str):
            return f"reference {j} must be a string, got {type(ref).__name__}"
        if not blank and not ref.strip():
            return f"reference {j} is empty"
        problem = text_problem(ref, f"reference {j}")
        if problem:
            return problem
    return None


def _image_sources(info: MetricInfo, images: Sequence[Any] | None, ids: list[int], reader: ImageReader | None,
                   problems: ProblemReport, checked: dict) -> list[ImageSource | None] | None:
    n = len(ids)
    if info.images == "never":
        return None
    if images is None:
        if info.images == "always":
            raise InputError(f"{info.name} needs an image for every caption")
        return None
    if isinstance(images, (str, bytes, os.PathLike, Image.Image)):
        raise InputError("images must be a sequence with one image per caption, got a single image")
    refuse_unordered(images, "images")
    if (isinstance(images, np.ndarray) or is_tensor(images)) and images.ndim == 4:
        images = list(images)  # a (N, C, H, W) or (N, H, W, C) stack
    try:
        images = list(images)
    except TypeError:
        raise InputError(f"images must be a sequence with one image per caption, got {type(images).__name__}") from None
    if len(images) != n:
        raise InputError(f"got {len(images)} images for {n} captions")
    sources: list[ImageSource | None] = []
    for i, image in zip(ids, images):
        try:
            if reader is not None:
                sources.append(reader.source(image, i))
            else:
                sources.append(image_source(image, i, video_ok=info.video, checked=checked))
        except InputError as err:
            problems.add(i, _reason(err, i))
            sources.append(None)
    return sources


def _reason(err: InputError, index: int) -> str:
    """The message of a per-sample error without its ``sample <index>:`` prefix."""
    text = str(err.args[0]) if err.args else str(err)
    prefix = f"sample {index}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def group_by_image(samples: Samples) -> list[int]:
    """Positions reordered so that captions of the same image are adjacent (first appearance order), so a
    batch holds all of an image's candidates and encodes the image once."""
    return image_runs(samples)[0]


def image_runs(samples: Samples) -> tuple[list[int], list[int]]:
    """:func:`group_by_image`'s order and the number of captions of each image along it (text only: one
    sample per run)."""
    if samples.images is None:
        return list(range(len(samples))), [1] * len(samples)
    first: dict[Any, int] = {}
    rank = [first.setdefault(src.key, len(first)) for src in samples.images]
    order = sorted(range(len(samples)), key=lambda p: rank[p])
    return order, np.bincount(np.asarray(rank, dtype=np.int64), minlength=len(first)).tolist()


def image_batches(samples: Samples, batch_size: int) -> list[list[int]]:
    """The positions of each batch of at most ``batch_size`` samples, in :func:`group_by_image`'s order, a
    batch ending at an image boundary wherever the next image's captions do not fit in it: an image's work
    (its encoding, an LVLM judge's prompt prefix) is done once, not once per batch it straddles. An image
    with more than ``batch_size`` captions fills whole batches of its own, its remainder opening the next
    batch. Without images: consecutive slices of ``batch_size``."""
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}")
    order, runs = image_runs(samples)
    if samples.images is None:
        return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    cuts, start, end = [], 0, 0  # the open batch is order[start:end]
    for run in runs:
        if end + run - start > batch_size and end > start:  # this image does not fit: close the batch
            cuts.append((start, end))
            start = end
        end += run
        while end - start > batch_size:  # an image larger than a batch
            cuts.append((start, start + batch_size))
            start += batch_size
    if end > start:
        cuts.append((start, end))
    return [order[a:b] for a, b in cuts]


def to_batch(samples: Samples, load: Callable[[ImageSource], Any] | None = None) -> Batch:
    """Decode the distinct images of ``samples`` once each (through ``load``, e.g. a cache shared between
    batches; default :meth:`ImageSource.load`) and build a :class:`Batch`."""
    images = image_index = None
    if samples.images is not None:
        rows: dict[Any, int] = {}
        unique: list[ImageSource] = []
        index = []
        for src in samples.images:
            if src.key not in rows:
                rows[src.key] = len(unique)
                unique.append(src)
            index.append(rows[src.key])
        images = [src.load() if load is None else load(src) for src in unique]
        image_index = np.array(index, dtype=np.int64)
    # int64 arrays: the batch makes tensors of them when a metric reads them (Batch.host reads them without)
    groups = None if samples.group_ids is None else np.array(samples.group_ids, dtype=np.int64)
    batch = Batch(
        candidates=list(samples.candidates),
        indices=np.array(samples.indices, dtype=np.int64),
        images=images,
        image_index=image_index,
        references=samples.references,
        group_ids=groups,
    )
    identities = None if images is None else [image_identity(s.key, img) for s, img in zip(unique, images)]
    batch.digests = text_digests(batch, identities)
    return batch


def iter_batches(
    samples: Samples, batch_size: int, *, progress: bool = False, desc: str | None = None
) -> Iterator[Batch]:
    """Batches of at most ``batch_size`` samples, candidates of one image kept together where they fit
    (:func:`image_batches`)."""
    plan = image_batches(samples, batch_size)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(samples), desc=desc, unit="sample")
    try:
        for positions in plan:
            chunk = samples.subset(positions)
            yield to_batch(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
