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

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from capeval_plugins.checkpoint import RunStore, batch_digest
from capeval_plugins.contract import Metric, MetricResult
from capeval_plugins.core.textcodec import decode_texts, encode_texts
from capeval_plugins.digests import ContentDigests, unresolved
from capeval_plugins.inputs import InputError, _reason, text_problem
from capeval_plugins.image_sources import ImageSource, image_source
from capeval_plugins.models.captioner import Captioner, as_captioner
from capeval_plugins.runner import Corpus, Interrupted, RunOutcome, Session, StopFlag, finish, policy, run

CAPTIONS = "captioner"  # the captioning stage's name in its run folder
CAPTION_BATCH = 8


@dataclass
class CaptionedRun:
    """The captions (one per image, input order; None where the image would not decode and ``on_error`` is
    ``"skip"``), each metric's result, and what the run did."""

    captions: list[str | None]
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
    docstring); ``restart`` discards what it holds. ``on_error``: as ``capeval score``'s; when every metric skips
    (``"skip"``), a sample whose image does not decode is not captioned (its caption is None) and every metric
    skips it with that reason, the others scored as if it were not there; else it is refused naming the sample.
    A caption that is not text, or an answer with another count than its batch, is refused in one line naming
    the sample."""
    metrics = named_metrics(metrics)
    captioner = as_captioner(predict, **captioner_options)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    describe = describe or (lambda i: f"sample {i}")
    skip = all(policy(metric, on_error) == "skip" for metric in metrics.values())  # else a metric would refuse it
    sources, unread = image_sources(images, describe, skip)
    # every metric's checks of the images and references, before the captioner loads (a caption stands in)
    Session(metrics, on_error=on_error, describe=describe).validate(
        Corpus(["a photo"] * len(images), list(images), references, describe=describe))
    check_some_read(sources, unread, describe)
    captions, failed, done, resumed = caption_images(
        captioner, sources, batch_size, describe=describe, skip=skip, progress=progress, restart=restart, stop=stop,
        run_dir=None if run_dir is None else caption_folder(run_dir))
    unread.update(failed)
    check_some_read(captions, unread, describe)
    corpus = captioned_corpus(captions, images, references, describe)
    outcome = run(metrics, corpus, on_error=on_error, run_dir=run_dir, restart=restart, progress=progress, stop=stop)
    if run_dir is not None:
        finish(run_dir, run_id=outcome.run_id)
        RunStore(caption_folder(run_dir)).remove()
    results = {name: with_unread(result, unread) for name, result in outcome.results.items()}
    texts = [captions.get(i) for i in range(len(images))]
    return CaptionedRun(texts, results, done, resumed, outcome)  # type: ignore[arg-type]


def check_some_read(read: Mapping[int, Any], unread: Mapping[int, str], describe: Callable[[int], str]) -> None:
    """Something to caption and score is left once the images that would not decode are skipped."""
    if not read:
        first = min(unread)
        raise InputError(f"no image could be read ({len(unread)} skipped; {describe(first)}: {unread[first]})")


def captioned_corpus(captions: Mapping[int, str], images: Sequence[Any], references: Sequence[Any] | None,
                     describe: Callable[[int], str]) -> Corpus:
    """The samples that have a caption, known by their own index: scored as if the others were not there."""
    kept, images = sorted(captions), list(images)
    if len(kept) == len(images):  # nothing skipped: the corpus as given (ids as positions, as before)
        return Corpus([captions[i] for i in kept], images, references, describe=describe)
    refs = None if references is None else list(references)
    return Corpus([captions[i] for i in kept], [images[i] for i in kept],
                  None if refs is None else [refs[i] for i in kept], ids=kept, describe=describe)


def with_unread(result: MetricResult, unread: Mapping[int, str]) -> MetricResult:
    """``result`` with the samples whose image would not decode back in place, skipped with that reason."""
    if not unread:
        return result
    whole = result.with_skipped({i: f"{reason} (not captioned)" for i, reason in unread.items()})
    return dataclasses.replace(whole, corpus_extras={**whole.corpus_extras, "n_skipped": float(len(whole.skipped))})


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


def image_sources(images: Sequence[Any], describe: Callable[[int], str],
                  skip: bool = False) -> tuple[dict[int, ImageSource], dict[int, str]]:
    """Every image checked before any model loads: the sources by sample, and with ``skip`` the reasons of the
    samples whose image is missing or unreadable; without, the first bad one is refused naming its sample."""
    if images is None or isinstance(images, (str, bytes, set, frozenset)) or not hasattr(images, "__len__") \
            or not len(images):
        raise InputError("images: give a non-empty sequence of images (paths, PIL images, arrays), in order")
    checked: dict = {}
    sources, unread = {}, {}
    for i, image in enumerate(images):
        try:
            sources[i] = image_source(image, i, checked=checked)
        except InputError as err:
            if not skip:
                raise InputError(f"{describe(i)}: {_reason(err, i)}") from None
            unread[i] = _reason(err, i)
    return sources, unread


def caption_images(captioner: Captioner, sources: Mapping[int, ImageSource], batch_size: int, *,
                   describe: Callable[[int], str], skip: bool = False, progress: bool = False,
                   run_dir: str | None = None, restart: bool = False,
                   stop: Callable[[], bool] | None = None) -> tuple[dict[int, str], dict[int, str], int, int]:
    """A caption for every sample of ``sources`` (an image given twice is captioned once), the reasons of the
    samples whose image would not decode (``skip``; else the first raises naming its sample), and the batches
    captioned now and those resumed from ``run_dir``."""
    first: dict[Any, int] = {}
    for i, source in sources.items():
        first.setdefault(source.key, i)
    distinct = list(first.values())
    plan = [distinct[k:k + batch_size] for k in range(0, len(distinct), batch_size)]
    store = _open_store(run_dir, captioner, sources, batch_size, restart) if run_dir is not None else None
    texts: list[list[str]] = []
    unread: dict[int, str] = {}
    captioned = 0
    if isinstance(stop, StopFlag):
        stop.scoring = True  # a signal now stops after the batch at work
    try:
        if store is not None:
            texts, unread = _saved_batches(store, plan, skip, describe)
        bar = _bar(progress, len(distinct), sum(len(batch) for batch in plan[:len(texts)]), captioner.name)
        for k in range(len(texts), len(plan)):
            batch = plan[k]
            images, failed = read_images(sources, batch, skip, describe)
            readable = [i for i in batch if i not in failed]
            answer = captioner.caption(images) if images else []
            texts.append(check_captions(answer, readable, captioner.name, describe))
            unread.update(failed)
            if store is not None:
                store.save(CAPTIONS, k, {"text": encode_texts(texts[-1], packed=True)}, None, failed,
                           batch_digest(batch))
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
    captions, failed = _by_sample(sources, plan, texts, unread)
    return captions, failed, captioned, len(plan) - captioned


def _saved_batches(store: RunStore, plan: Sequence[Sequence[int]], skip: bool,
                   describe: Callable[[int], str]) -> tuple[list[list[str]], dict[int, str]]:
    """The captions of the batches a run saved, and the samples it skipped."""
    saved = store.load(CAPTIONS, False, [batch_digest(batch) for batch in plan])
    if saved.skipped and not skip:  # saved by a run under on_error="skip", resumed under "raise"
        first = min(saved.skipped)
        raise InputError(f"{describe(first)}: {saved.skipped[first]}")
    return [decode_texts(rows["text"]) for rows in saved.rows], saved.skipped


def _by_sample(sources: Mapping[int, ImageSource], plan: Sequence[Sequence[int]], texts: Sequence[Sequence[str]],
               unread: Mapping[int, str]) -> tuple[dict[int, str], dict[int, str]]:
    """Every sample's caption, or the reason its image was not captioned (a repeated image shares both)."""
    read = [i for batch in plan for i in batch if i not in unread]  # in the order the texts were written
    text_of = {sources[i].key: text for i, text in zip(read, (text for done in texts for text in done))}
    reason_of = {sources[i].key: reason for i, reason in unread.items()}
    captions = {i: text_of[s.key] for i, s in sources.items() if s.key in text_of}
    return captions, {i: reason_of[s.key] for i, s in sources.items() if s.key in reason_of}


def read_images(sources: Mapping[int, ImageSource], batch: Sequence[int], skip: bool,
                describe: Callable[[int], str]) -> tuple[list[Any], dict[int, str]]:
    """The decoded images of ``batch`` and, with ``skip``, the reasons of those whose pixels would not decode
    (a header that decodes is no promise: a truncated file fails only here); without, the first is refused
    naming its sample."""
    images, failed = [], {}
    for i in batch:
        try:
            images.append(sources[i].load())
        except InputError as err:
            if not skip:
                raise InputError(f"{describe(i)}: {_reason(err, i)}") from None
            failed[i] = _reason(err, i)
    return images, failed


def _open_store(run_dir: str, captioner: Captioner, sources: Mapping[int, ImageSource], batch_size: int,
                restart: bool) -> RunStore:
    contents = ContentDigests()
    images = Corpus([None] * len(sources), [s.value for s in sources.values()]).digest(contents)
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
