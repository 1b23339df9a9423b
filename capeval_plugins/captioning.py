"""Drive a captioner and score its captions: :func:`caption_and_score` (``capeval caption`` is its command).

The images are checked first (every one, before any model loads), then captioned in batches, each distinct
image once (a captioner is greedy by default, so one image has one caption), then the captions go through the
one scoring pass every entry point uses (:func:`capeval_plugins.runner.run`), with every metric at once.

Both stages are resumable. With ``run_dir``, every finished caption batch is saved in ``<run_dir>.captions``
(a run folder of :mod:`capeval_plugins.checkpoint`: locked, authenticated, refused when it holds another run)
and the scoring in ``run_dir`` itself, as ``capeval score`` keeps it; the same call after an interruption
captions only what was not captioned yet (a finished captioning loads no captioner at all) and scores only what
was not scored, and ends with the captions and scores of an uninterrupted run. Both folders are removed when the
run is complete.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from capeval_plugins.checkpoint import RunStore, batch_digest
from capeval_plugins.contract import Metric, MetricResult
from capeval_plugins.core.textcodec import decode_texts, encode_texts
from capeval_plugins.digests import ContentDigests, unresolved
from capeval_plugins.inputs import InputError, text_problem
from capeval_plugins.image_sources import ImageSource, image_source
from capeval_plugins.models.captioner import Captioner, as_captioner
from capeval_plugins.runner import Corpus, Interrupted, RunOutcome, Session, StopFlag, finish, run

CAPTIONS = "captioner"  # the captioning stage's name in its run folder
CAPTION_BATCH = 8


@dataclass
class CaptionedRun:
    """The captions (one per image, input order), each metric's result, and what the run did."""

    captions: list[str]
    results: dict[str, MetricResult]
    batches_captioned: int = 0
    batches_resumed: int = 0
    outcome: RunOutcome | None = None


def caption_folder(run_dir: str | os.PathLike) -> str:
    """Where the captioning stage of a run in ``run_dir`` keeps its batches: beside it (``run/`` too gives
    ``run.captions``, never a folder inside the run folder, which holds only the scoring's files)."""
    return f"{os.path.normpath(os.fspath(run_dir))}.captions"


def caption_and_score(images: Sequence[Any], metrics: Mapping[str, Metric] | Sequence[Any] | Metric | str,
                      predict: Any, references: Sequence[Any] | None = None, *, batch_size: int = CAPTION_BATCH,
                      run_dir: str | os.PathLike | None = None, restart: bool = False, progress: bool = False,
                      on_error: str | None = None, describe: Callable[[int], str] | None = None,
                      stop: Callable[[], bool] | None = None, **captioner_options: Any) -> CaptionedRun:
    """Caption ``images`` with ``predict`` and score the captions with ``metrics`` in one call.

    ``predict``: a Hugging Face image-to-text model (hub id or local path; ``captioner_options``: ``prompt``,
    ``max_new_tokens``, ``num_beams``, ``device``, ``dtype``, ``revision``, ``trust_remote_code``) or a function
    ``predict(images) -> captions`` given a batch of decoded RGB PIL images. ``metrics``: ``{name: metric}``,
    metrics, or registered names. ``references``: per image, for reference-based metrics. ``batch_size``:
    images per captioning batch (the metrics batch at their own sizes). ``run_dir``: resumable (see the module
    docstring); ``restart`` discards what it holds. A caption that is not text, or an answer with another
    count than its batch, is refused in one line naming the sample."""
    metrics = named_metrics(metrics)
    captioner = as_captioner(predict, **captioner_options)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    describe = describe or (lambda i: f"sample {i}")
    sources = image_sources(images, describe)
    # every metric's checks of the images and references, before the captioner loads (a caption stands in)
    Session(metrics, on_error=on_error, describe=describe).validate(
        Corpus(["a photo"] * len(sources), list(images), references, describe=describe))
    captions, done, resumed = caption_images(captioner, sources, batch_size, describe=describe, progress=progress,
                                             run_dir=None if run_dir is None else caption_folder(run_dir),
                                             restart=restart, stop=stop)
    corpus = Corpus(captions, list(images), references, describe=describe)
    outcome = run(metrics, corpus, on_error=on_error, run_dir=run_dir, restart=restart, progress=progress, stop=stop)
    if run_dir is not None:
        finish(run_dir, run_id=outcome.run_id)
        RunStore(caption_folder(run_dir)).remove()
    return CaptionedRun(captions, outcome.results, done, resumed, outcome)  # type: ignore[arg-type]


def named_metrics(metrics: Any) -> dict[str, Metric]:
    """``{name: metric}`` from a mapping, one metric or name, or a sequence of metrics and registered names."""
    from capeval_plugins import registry

    if isinstance(metrics, (str, Metric)):
        metrics = [metrics]
    pairs = list(metrics.items()) if isinstance(metrics, Mapping) else [(None, m) for m in metrics]
    out: dict[str, Metric] = {}
    for name, metric in pairs:
        metric = registry.load(metric) if isinstance(metric, str) else metric
        if not isinstance(metric, Metric):
            raise InputError(f"metrics: {type(metric).__name__} is not a metric (capeval_plugins.load(name))")
        out[metric.info.name if name is None else name] = metric
    if not out:
        raise InputError("no metric given")
    return out


def image_sources(images: Sequence[Any], describe: Callable[[int], str]) -> list[ImageSource]:
    """Every image checked before any model loads; the first bad one is refused naming its sample."""
    if images is None or isinstance(images, (str, bytes, set, frozenset)) or not hasattr(images, "__len__") \
            or not len(images):
        raise InputError("images: give a non-empty sequence of images (paths, PIL images, arrays), in order")
    checked: dict = {}
    sources = []
    for i, image in enumerate(images):
        try:
            sources.append(image_source(image, i, checked=checked))
        except InputError as err:
            raise InputError(str(err).replace(f"sample {i}", describe(i), 1)) from None
    return sources


def caption_images(captioner: Captioner, sources: Sequence[ImageSource], batch_size: int, *,
                   describe: Callable[[int], str], progress: bool = False, run_dir: str | None = None,
                   restart: bool = False, stop: Callable[[], bool] | None = None) -> tuple[list[str], int, int]:
    """One caption per source (an image given twice is captioned once), the batches captioned now and those
    resumed from ``run_dir``."""
    first: dict[Any, int] = {}
    for i, source in enumerate(sources):
        first.setdefault(source.key, i)
    distinct = list(first.values())
    plan = [distinct[k:k + batch_size] for k in range(0, len(distinct), batch_size)]
    store = _open_store(run_dir, captioner, sources, batch_size, restart) if run_dir is not None else None
    texts: list[list[str]] = []
    captioned = 0
    if isinstance(stop, StopFlag):
        stop.scoring = True  # a signal now stops after the batch at work
    try:
        if store is not None:
            saved = store.load(CAPTIONS, False, [batch_digest(batch) for batch in plan])
            texts = [decode_texts(rows["text"]) for rows in saved.rows]
        bar = _bar(progress, len(distinct), sum(map(len, texts)), captioner.name)
        for k in range(len(texts), len(plan)):
            batch = plan[k]
            answer = captioner.caption([sources[i].load() for i in batch])
            texts.append(check_captions(answer, batch, captioner.name, describe))
            if store is not None:
                store.save(CAPTIONS, k, {"text": encode_texts(texts[-1], packed=True)}, None, {}, batch_digest(batch))
            captioned += 1
            if bar is not None:
                bar.update(len(batch))
            if stop is not None and k + 1 < len(plan) and stop():
                where = f", saved in {run_dir}" if run_dir else ""
                raise Interrupted(f"interrupted after captioning {k + 1} of {len(plan)} batches{where}")
        if bar is not None:
            bar.close()
    except BaseException:
        if store is not None and not store.had_progress and not captioned:
            store.remove()  # nothing to resume
        raise
    finally:
        captioner.release()
        if isinstance(stop, StopFlag):
            stop.scoring = False
        if store is not None:
            store.close()
    by_key = {sources[i].key: text for batch, done in zip(plan, texts) for i, text in zip(batch, done)}
    return [by_key[source.key] for source in sources], captioned, len(plan) - captioned


def _open_store(run_dir: str, captioner: Captioner, sources: Sequence[ImageSource], batch_size: int,
                restart: bool) -> RunStore:
    contents = ContentDigests()
    images = Corpus([None] * len(sources), [s.value for s in sources]).digest(contents)
    identity = captioner.identity()
    if unresolved(identity.get("model")):  # a hub model not cached yet: downloaded now, so the run is keyed by
        captioner.load()                    # its commit (else a resumed run would find another captioner)
        identity = captioner.identity()
    store = RunStore(run_dir)
    store.open({"metrics": {CAPTIONS: identity}, "inputs": images, "batch_size": batch_size}, restart)
    return store


def check_captions(answer: Any, batch: Sequence[int], name: str, describe: Callable[[int], str]) -> list[str]:
    """The captioner's answer for ``batch``: one text per image, else one line naming the first bad sample."""
    if isinstance(answer, (str, bytes)) or not hasattr(answer, "__len__"):
        raise InputError(f"captioner {name}: returned {type(answer).__name__} for {len(batch)} images; expected a "
                         "list of captions, one per image")
    answer = list(answer)
    if len(answer) != len(batch):
        raise InputError(f"captioner {name}: returned {len(answer)} captions for {len(batch)} images (the batch of "
                         f"{describe(batch[0])}); expected one per image")
    for i, caption in zip(batch, answer):
        problem = (f"caption is {type(caption).__name__} {str(caption)[:40]!r}, not text"
                   if not isinstance(caption, str) else text_problem(caption, "caption"))
        if problem:
            raise InputError(f"captioner {name}: {describe(i)}: {problem}")
    return [str(caption) for caption in answer]


def _bar(enabled: bool, total: int, initial: int, name: str) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=f"captioning ({name})", unit="image", dynamic_ncols=True)
