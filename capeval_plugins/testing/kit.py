"""The metric test kit: the properties every metric must have to run in every ecosystem, checked on yours.

What torchmetrics' ``MetricTester`` does for its metrics, for a metric written against the contract (a plugin's
or one of the package's own). A **factory** builds a fresh metric from option overrides (the kit passes
``batch_size=...``): the metric class itself, a registered name, or a function such as
``lambda **o: MyMetric(model=path, **o)``. A class or name that declares :meth:`Metric.tiny_recipe` is built with
that recipe. The samples are a :class:`~capeval_plugins.runner.Corpus`; :func:`sample_corpus` makes a small one
of PNG files, captions and references for any :class:`~capeval_plugins.contract.MetricInfo`.

Each check is a plain function ``check_x(factory, corpus)``: it returns when the property holds, raises
:class:`KitFailure` (an ``AssertionError``) naming what differs, or :class:`CheckSkipped` when it does not apply
(an ecosystem that is not installed, a metric that is not registered). :func:`check_metric` runs them all;
:class:`MetricTests` makes one pytest test of each::

    from capeval_plugins.testing import kit
    kit.check_metric(MyMetric)                         # every check; a KitFailure lists what failed

    class TestMyMetric(kit.MetricTests):               # in a test file: one test per check
        factory = MyMetric

docs/adding-a-metric.md says what each check means for a metric author.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from capeval_plugins import registry, runner
from capeval_plugins.core.arrays import as_tensor, host, is_tensor, same_kind
from capeval_plugins.contract import (Metric, MetricInfo, MetricResult, PackedTexts, StateSpec, full_spec,
                                      merge_states)

Factory = Callable[..., Metric]
BLANKS = ("", "   ", "\t")  # an empty or blank caption is an answer: scored, never skipped


class KitFailure(AssertionError):
    """A property of the contract that the metric does not have."""


class CheckSkipped(Exception):
    """A check that does not apply here (its ecosystem is not installed, the metric is not registered, ...)."""


@dataclass(frozen=True)
class Tolerance:
    """How close two numbers must be where the computation legitimately differs in its last bits: another batch
    size pads other rows together (float32 model forwards), another ecosystem reaches the same code another way.
    Resume and the rows of a DDP merge are compared bit for bit whatever this says."""

    rtol: float = 1e-5
    atol: float = 1e-6


# ---------------------------------------------------------------------------------------------------------
# Factories and samples


def as_factory(target: Factory | type[Metric] | str) -> Factory:
    """A factory from a metric class or registered name (built with its :meth:`~Metric.tiny_recipe` if it
    declares one, else its defaults), or ``target`` itself."""
    if isinstance(target, str):
        target = registry.get(target).cls
    if isinstance(target, type) and issubclass(target, Metric):
        cls, recipe = target, dict(target.tiny_recipe() or {})
        return lambda **overrides: cls(**{**recipe, **overrides})
    return target


def sample_corpus(info: MetricInfo, n_images: int = 6, captions_per_image: int = 2, seed: int = 0,
                  folder: str | Path | None = None) -> runner.Corpus:
    """A corpus the metric ``info`` describes can score: ``captions_per_image`` captions for each of ``n_images``
    PNG files of random pixels and different sizes (a video: two frames each), two references per caption where
    the metric reads references. Written into ``folder`` (default: a private temporary folder removed when the
    process exits); files already there are kept."""
    from PIL import Image

    from capeval_plugins import files
    from capeval_plugins.testing import scratch_folder
    from capeval_plugins.testing.corpus import caption_corpus

    n = n_images * captions_per_image
    lines = caption_corpus(3 * n, seed=seed)
    images = None
    if info.images != "never":
        folder = Path(folder) if folder is not None else scratch_folder("capeval-kit-")
        rng = np.random.default_rng(seed)
        paths = []
        with files.Folder.open(folder, create=True)[0] as where:
            for k in range(n_images * (2 if info.video else 1)):
                pixels = rng.integers(0, 256, size=(32 + 4 * (k % 3), 40 + 6 * (k % 4), 3), dtype=np.uint8)
                buffer = io.BytesIO()
                Image.fromarray(pixels).save(buffer, format="PNG")
                name = f"kit-{seed}-{k}.png"
                if where.kind(name) is None:
                    where.write(name, buffer.getvalue(), replace=False)
                paths.append(str(folder / name))
        per_image = [paths[2 * k: 2 * k + 2] for k in range(n_images)] if info.video else paths
        images = [per_image[i // captions_per_image] for i in range(n)]
    references = None
    if info.references != "never":
        references = [[lines[n + 2 * i], lines[n + 2 * i + 1]] for i in range(n)]
    return runner.Corpus(list(lines[:n]), images, references)


def _part(corpus: runner.Corpus, start: int, stop: int) -> runner.Corpus:
    """Samples ``start:stop`` of ``corpus``, keeping their ids."""
    cut = lambda values: None if values is None else list(values)[start:stop]  # noqa: E731
    ids = list(corpus.ids) if corpus.ids is not None else list(range(len(corpus.candidates)))
    return runner.Corpus(cut(corpus.candidates), cut(corpus.images), cut(corpus.references),
                         cut(corpus.group_ids), ids[start:stop])


def _score(metric: Metric, corpus: runner.Corpus) -> MetricResult:
    return metric(corpus.images, corpus.candidates, corpus.references, group_ids=corpus.group_ids, ids=corpus.ids)


# ---------------------------------------------------------------------------------------------------------
# Comparing


def same_bits(a: Any, b: Any) -> bool:
    """Equal shape, dtype and bits (NaN equal to NaN), arrays or tensors alike."""
    if is_tensor(a) != is_tensor(b):
        return False
    if is_tensor(a) and a.dtype != b.dtype:
        return False
    a, b = host(a), host(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = np.isnan(a) & np.isnan(b) if np.issubdtype(a.dtype, np.floating) else np.zeros(a.shape, dtype=bool)
    return bool(((a == b) | nan).all())


def _close(a: Any, b: Any, tolerance: Tolerance | None) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return list(a) == list(b)
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    a, b = as_tensor(host(a)).double(), as_tensor(host(b)).double()
    if tolerance is None:
        return same_bits(a, b)
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True))


def compare_results(got: MetricResult, want: MetricResult, what: str, tolerance: Tolerance | None) -> None:
    """``got`` equals ``want`` (``tolerance`` None: bit for bit): per-sample ids, scores, extras, corpus score and
    extras, skipped samples. A :class:`KitFailure` names ``what`` and the first difference."""
    def fail(detail: str) -> None:
        raise KitFailure(f"{want.name}: {what}: {detail}")

    if not np.array_equal(host(got.indices).astype(np.int64), host(want.indices).astype(np.int64)):
        fail(f"sample ids {got.indices.tolist()} != {want.indices.tolist()}")
    if not _close(got.scores, want.scores, tolerance):
        worst = float(np.nan_to_num(np.abs(host(got.scores).astype(np.float64) - host(want.scores).astype(np.float64)),
                                    nan=math.inf).max())
        fail(f"per-sample scores differ (largest difference {worst:.3g}): {got.scores.tolist()} != "
             f"{want.scores.tolist()}")
    if not _close(got.score, want.score, tolerance):
        fail(f"corpus score {got.score!r} != {want.score!r}")
    if got.extras.keys() != want.extras.keys():
        fail(f"extras {sorted(got.extras)} != {sorted(want.extras)}")
    for key, value in want.extras.items():
        if not _close(got.extras[key], value, tolerance):
            fail(f"extra {key!r} differs")
    if got.corpus_extras.keys() != want.corpus_extras.keys():
        fail(f"corpus extras {sorted(got.corpus_extras)} != {sorted(want.corpus_extras)}")
    for key, value in want.corpus_extras.items():
        if not _close(got.corpus_extras[key], value, tolerance):
            fail(f"corpus extra {key!r}: {got.corpus_extras[key]!r} != {value!r}")
    if got.skipped.keys() != want.skipped.keys():
        fail(f"skipped samples {sorted(got.skipped)} != {sorted(want.skipped)}")


def _compare_scores(name: str, what: str, scores: Sequence[float], score: float, want: MetricResult,
                    tolerance: Tolerance) -> None:
    got = MetricResult(want.name, float(score), same_kind(np.asarray(list(scores), dtype=np.float64), want.scores),
                       want.indices)
    compare_results(got, dataclasses.replace(want, extras={}, corpus_extras={}, skipped={}), what, tolerance)


# ---------------------------------------------------------------------------------------------------------
# The checks


def check_batch_split(factory: Factory, corpus: runner.Corpus, tolerance: Tolerance = Tolerance(),
                      batch_sizes: Sequence[int] = (1, 3)) -> None:
    """A sample's score does not depend on its batch: the corpus scored at other ``batch_sizes`` and fed as a
    stream of uneven ``update()`` calls (each batch mapped as it comes, without :meth:`Metric.prepare_corpus`)
    equals one call."""
    factory = as_factory(factory)
    want = _score(factory(), corpus)
    for size in batch_sizes:
        compare_results(_score(factory(batch_size=size), corpus), want, f"batch_size={size} vs the default",
                        tolerance)
    n = len(corpus.candidates)
    for cuts in ([0, 1, 3, n], [0, n - 1, n]):
        compare_results(_stream(factory(), corpus, cuts), want, f"updates of {np.diff(cuts).tolist()} samples",
                        tolerance)


def _stream(metric: Metric, corpus: runner.Corpus, cuts: Sequence[int]) -> MetricResult:
    """``corpus`` fed to one session in the pieces ``cuts`` marks, as a streaming adapter feeds its updates."""
    name = metric.info.name
    session = runner.Session({name: metric})
    states, skipped = [], {}
    for start, stop in zip(cuts[:-1], cuts[1:]):
        if stop > start:
            samples, left_out = session.validate(_part(corpus, start, stop))[name]
            skipped.update(left_out)
            states += _feed(session, name, session.batches(name, samples), skipped)
    return session.finalize(name, session.merge(name, states), skipped)


def _feed(session: runner.Session, name: str, parts: Sequence[Any], skipped: dict) -> list[dict[str, Tensor]]:
    """``parts`` (batches) scored in one pass of the session's loop, each mapped alone as it comes (no whole-pass
    hook), and each batch's own state (its rows and its own sums) kept as it finishes."""
    out: list[dict[str, Tensor]] = []
    if not parts:
        return out

    def keep(plan: Any, done: Any) -> None:
        skipped.update(done.skipped)
        if len(done.skipped) < len(done.part):  # a batch every sample of which was left out adds nothing
            out.append({**done.rows, **done.sums})

    session.run([runner.Plan(name, _joined(parts), list(parts))], on_batch=keep, prepare=False)
    return out


def _joined(parts: Sequence[Any]) -> Any:
    """The samples of ``parts`` as one :class:`~capeval_plugins.inputs.Samples`, in their order."""
    def join(field: str) -> list | None:
        values = [getattr(part, field) for part in parts]
        return None if not values or values[0] is None else [v for value in values for v in value]

    first = parts[0]
    return dataclasses.replace(first, **{f: join(f) for f in ("candidates", "indices", "images", "references",
                                                               "group_ids")})


def check_ddp_merge(factory: Factory, corpus: runner.Corpus, tolerance: Tolerance = Tolerance(),
                    world_sizes: Sequence[int] = (2, 3)) -> None:
    """Ranks merge to one process: the batches of one process handed out to ``world_sizes`` ranks, each mapping its
    share with a metric of its own (another process), merged per rank and across ranks by
    :func:`~capeval_plugins.contract.merge_states`, give one process's state: ``"cat"`` rows and integer sums bit
    for bit, floating sums within the rounding of adding in another order; the finalized results agree. A
    metric without sums also drops the repeat a padding ``DistributedSampler`` adds on the last rank."""
    factory = as_factory(factory)
    metric = factory(batch_size=2)
    name = metric.info.name
    session = runner.Session({name: metric})
    samples, skipped = session.validate(corpus)[name]
    parts = session.batches(name, samples)
    batch_states = _feed(session, name, parts, {})
    spec = full_spec(metric)
    one = merge_states(spec, batch_states)
    want = session.finalize(name, one, skipped)
    for world in world_sizes:
        if len(parts) < world:
            raise KitFailure(f"{name}: the corpus makes {len(parts)} batches of 2, too few for {world} ranks")
        shares = np.array_split(np.arange(len(parts)), world)
        ranks = []
        for share in shares:
            rank = runner.Session({name: factory(batch_size=2)})  # a process of its own
            ranks.append(rank.merge(name, _feed(rank, name, [parts[k] for k in share], {})))
        merged = merge_states(spec, ranks)
        _compare_states(spec, merged, one, batch_states, f"{world} ranks")
        compare_results(session.finalize(name, merged, skipped), want, f"{world} ranks merged vs one process",
                        tolerance)
        if all(s.reduce == "cat" for s in metric.states().values()):
            padded = merge_states(spec, [*ranks, _feed(rank, name, [parts[0].subset([0])], {})[0]])
            got = session.finalize(name, padded, skipped, allowed_repeats=world - 1)
            if got.corpus_extras.pop("n_repeats_dropped", None) != 1:
                raise KitFailure(f"{name}: the padding sampler's repeat was not counted in n_repeats_dropped")
            compare_results(got, want, f"{world} ranks with a padding sampler's repeat", None)


def _compare_states(spec: Mapping[str, StateSpec], got: Mapping[str, Any], want: Mapping[str, Any],
                    parts: Sequence[Mapping[str, Any]], what: str) -> None:
    for key, s in spec.items():
        a, b = got[key], want[key]
        if isinstance(a, PackedTexts) or isinstance(b, PackedTexts):
            same = PackedTexts.join([a]).rows() == PackedTexts.join([b]).rows()
        elif s.reduce == "cat" or not np.issubdtype(host(a).dtype, np.floating):
            same = same_bits(a, b)
        else:  # another order of additions: each order is within n eps sum|x| of the exact sum
            magnitude = sum(np.abs(host(p[key]).astype(np.float64)) for p in parts if key in p)
            eps = torch.finfo(a.dtype).eps if is_tensor(a) else np.finfo(a.dtype).eps  # (bfloat16's own)
            bound = 2 * len(parts) * eps * magnitude
            a, b = host(a).astype(np.float64), host(b).astype(np.float64)
            same = a.shape == b.shape and bool((np.abs(a - b) <= bound).all())
        if not same:
            raise KitFailure(f"{what}: merged state {key!r} ({s.reduce}) differs from one process's: a state must "
                             "merge by its declared reduce alone (rows concatenated, sums added), and map must not "
                             "depend on what the metric mapped before")


class _StopAfter:
    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def __call__(self) -> bool:
        self.seen += 1
        return self.seen >= self.n


def check_resume(factory: Factory, corpus: runner.Corpus, folder: str | Path | None = None) -> None:
    """A run interrupted half-way and resumed from its run folder ends with the same bits as an uninterrupted
    run (a fresh metric for each run, as after a restart)."""
    from capeval_plugins.testing import scratch_folder

    factory = as_factory(factory)
    build = lambda: factory(batch_size=2)  # noqa: E731
    name = build().info.name
    whole = runner.run({name: build()}, corpus).results[name]
    session = runner.Session({name: build()})
    batches = len(session.batches(name, session.validate(corpus)[name][0]))
    if batches < 2:
        raise KitFailure(f"{name}: the corpus makes {batches} batch of 2: too small to interrupt")
    run_dir = Path(folder if folder is not None else scratch_folder("capeval-kit-run-")) / "run"
    stop = batches // 2
    try:
        runner.run({name: build()}, corpus, run_dir=run_dir, stop=_StopAfter(stop))
    except runner.Interrupted:
        pass
    else:
        raise KitFailure(f"{name}: the run was not interrupted after batch {stop} of {batches}")
    resumed = runner.run({name: build()}, corpus, run_dir=run_dir)
    runner.finish(run_dir, run_id=resumed.run_id)
    if resumed.batches_resumed != stop:
        raise KitFailure(f"{name}: {resumed.batches_resumed} batches resumed, {stop} were saved")
    compare_results(resumed.results[name], whole, "resumed run vs uninterrupted run", None)


def check_empty_captions(factory: Factory, corpus: runner.Corpus) -> None:
    """An empty or blank caption is an answer: every sample is scored (none skipped), with a finite number inside
    ``MetricInfo.score_range``."""
    factory = as_factory(factory)
    metric = factory()
    captions = list(corpus.candidates)
    for k, blank in enumerate(BLANKS):
        captions[(k * 5) % len(captions)] = blank
    blanked = dataclasses.replace(corpus, candidates=captions)
    result = _score(metric, blanked)
    name = metric.info.name
    if result.skipped:
        raise KitFailure(f"{name}: blank captions were skipped, not scored: {result.skipped}")
    if not np.isfinite(host(result.scores)).all() or not math.isfinite(result.score):
        raise KitFailure(f"{name}: scores with blank captions are not all finite: {result.scores.tolist()}")
    bounds = metric.info.score_range
    if bounds is not None and not (bounds[0] <= float(result.scores.min()) and float(result.scores.max()) <= bounds[1]):
        raise KitFailure(f"{name}: a score outside MetricInfo.score_range {bounds}: {result.scores.tolist()}")


def check_row_order(factory: Factory, corpus: runner.Corpus) -> None:
    """``map`` returns its rows in its batch's order: the session's :func:`~capeval_plugins.runner.check_row_order`
    (three samples mapped again in another order must come back in that order)."""
    metric = as_factory(factory)(batch_size=max(3, len(corpus.candidates)))
    name = metric.info.name
    session = runner.Session({name: metric})
    part = session.batches(name, session.validate(corpus)[name][0])[0]
    try:
        runner.check_row_order(metric, part, session.cache, strict=True)
    except runner.RowOrderError as err:
        raise KitFailure(str(err)) from err


def check_card(factory: Factory, corpus: runner.Corpus | None = None) -> None:
    """The metric has a card (Hugging Face's metric-card format, what ``evaluate`` shows as its description) with
    every section, every option by name and one paragraph saying what its defaults reproduce
    (:func:`capeval_plugins.cards.card_problems`)."""
    from capeval_plugins.cards import card_problems

    problems = card_problems(type(as_factory(factory)()))
    if problems:
        raise KitFailure("; ".join(problems))


# ---------------------------------------------------------------------------------------------------------
# Every ecosystem gives the same number


def options_of(metric: Metric) -> dict[str, Any]:
    """The options a metric was built with that differ from its defaults (what a name-based entry point needs)."""
    defaults = type(metric.config)()
    return {f.name: getattr(metric.config, f.name) for f in dataclasses.fields(metric.config)
            if getattr(metric.config, f.name) != getattr(defaults, f.name)}


def _registered(metric: Metric) -> bool:
    entry = registry.metrics().get(metric.info.name)
    return entry is not None and entry.cls is type(metric)


def _require(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise CheckSkipped(f"{module} is not installed")


def check_torchmetrics(factory: Factory, corpus: runner.Corpus, tolerance: Tolerance = Tolerance()) -> None:
    """``capeval_plugins.torchmetrics.<Class>`` fed in uneven ``update()`` calls equals the direct call."""
    _require("torchmetrics")
    factory = as_factory(factory)
    metric = factory()
    want = _score(metric, corpus)
    from capeval_plugins.adapters.naming import identifier
    from capeval_plugins.adapters.torchmetrics import CapevalMetric, metric_class

    # a registered metric: the class ``capeval_plugins.torchmetrics.<display name>`` resolves to
    cls = metric_class.attribute(identifier(metric.info)) if _registered(metric) else CapevalMetric
    streamed = cls(metric=factory())
    n = len(corpus.candidates)
    for start, stop in ((0, 1), (1, n // 2), (n // 2, n)):
        piece = _part(corpus, start, stop)
        streamed.update(piece.images, piece.candidates, piece.references, ids=piece.ids, group_ids=piece.group_ids)
    compare_results(streamed.compute_all(), want, "torchmetrics update()s vs the direct call", tolerance)


def check_evaluate(factory: Factory, corpus: runner.Corpus, tolerance: Tolerance = Tolerance()) -> None:
    """``evaluate.load("capeval/<name>", **options).compute(...)`` equals the direct call (a registered metric)."""
    _require("evaluate")
    metric = as_factory(factory)()
    if not _registered(metric):
        raise CheckSkipped(f"{metric.info.name} is not registered: evaluate loads metrics by name")
    import evaluate

    want = _score(metric, corpus)
    inputs = {"predictions": list(corpus.candidates)}
    for key, value in (("images", corpus.images), ("references", corpus.references), ("group_ids", corpus.group_ids)):
        if value is not None:
            inputs[key] = list(value)
    # "capeval/<name>": the spelling every metric has (a plain name may be evaluate's own metric, e.g. bertscore)
    out = evaluate.load("capeval/" + metric.info.name, **options_of(metric)).compute(**inputs)
    _compare_scores(metric.info.name, "evaluate vs the direct call", out["scores"], out[metric.info.name], want,
                    tolerance)


def check_pycocoevalcap(factory: Factory, corpus: runner.Corpus, tolerance: Tolerance = Tolerance()) -> None:
    """The pycocoevalcap scorer's ``compute_score(gts, res)`` (one caption per id, images by file path) equals the
    direct call, where that interface fits the metric."""
    _require("pycocoevalcap")
    metric = as_factory(factory)()
    info = metric.info
    if info.groups or info.video or corpus.group_ids is not None:
        raise CheckSkipped("pycocoevalcap's scorers take one image and one caption per id: no groups, no videos")
    if info.references != "never" and corpus.references is None:
        raise CheckSkipped("pycocoevalcap always passes references (gts); the corpus has none")
    if corpus.images is not None and not all(isinstance(i, (str, Path)) for i in corpus.images):
        raise CheckSkipped("pycocoevalcap finds images by id: give the corpus's images as file paths")
    from capeval_plugins.adapters.naming import coco_identifier
    from capeval_plugins.adapters.pycocoevalcap import CapevalScorer, ImageResolver, scorer_class

    # a registered metric: the class ``capeval_plugins.pycocoevalcap.<Name>`` resolves to
    cls = scorer_class.attribute(coco_identifier(info)) if _registered(metric) else CapevalScorer
    n = len(corpus.candidates)
    resolver = None
    if corpus.images is not None and info.images != "never":
        resolver = ImageResolver("/", mapping={i: str(Path(p).resolve()) for i, p in enumerate(corpus.images)})
    gts = {i: list(corpus.references[i]) if corpus.references is not None else [] for i in range(n)}
    score, items = cls(resolver=resolver, metric=as_factory(factory)()).compute_score(
        gts, {i: [c] for i, c in enumerate(corpus.candidates)})
    want = _score(metric, dataclasses.replace(corpus, ids=None))
    _compare_scores(info.name, "pycocoevalcap vs the direct call", list(items), float(score), want, tolerance)


def check_lm_eval(factory: Factory, corpus: runner.Corpus, tolerance: Tolerance = Tolerance()) -> None:
    """lm-eval's aggregation of one item per document equals the direct call's corpus score (a registered
    metric; no explicit group ids)."""
    _require("lm_eval")
    metric = as_factory(factory)()
    if not _registered(metric):
        raise CheckSkipped(f"{metric.info.name} is not registered: lm-eval finds metrics by name")
    if corpus.group_ids is not None:
        raise CheckSkipped("lm-eval documents carry no group ids")
    from capeval_plugins.adapters.lm_eval import CaptionItem, aggregate

    n = len(corpus.candidates)
    items = [CaptionItem(corpus.images[i] if corpus.images is not None else None, corpus.candidates[i],
                         list(corpus.references[i]) if corpus.references is not None else None) for i in range(n)]
    got = aggregate(metric.info.name, items, **options_of(metric))
    want = _score(metric, dataclasses.replace(corpus, ids=None))
    if not _close(got, want.score, tolerance):
        raise KitFailure(f"{metric.info.name}: lm-eval's corpus score {got!r} != the direct call's {want.score!r}")


# ---------------------------------------------------------------------------------------------------------
# All of them


CHECKS: dict[str, Callable[..., None]] = {
    "batch_split": check_batch_split, "ddp_merge": check_ddp_merge, "resume": check_resume,
    "empty_captions": check_empty_captions, "row_order": check_row_order, "card": check_card,
    "torchmetrics": check_torchmetrics,
    "evaluate": check_evaluate, "pycocoevalcap": check_pycocoevalcap, "lm_eval": check_lm_eval,
}
TOLERANT = {"batch_split", "ddp_merge", "torchmetrics", "evaluate", "pycocoevalcap", "lm_eval"}


def run_check(check: str, factory: Factory, corpus: runner.Corpus, tolerance: Tolerance = Tolerance()) -> None:
    """One check of :data:`CHECKS` by name."""
    fn = CHECKS[check]
    fn(factory, corpus, tolerance) if check in TOLERANT else fn(factory, corpus)


def check_metric(factory: Factory | type[Metric] | str, corpus: runner.Corpus | None = None, *,
                 checks: Sequence[str] | None = None, tolerance: Tolerance = Tolerance()) -> dict[str, str]:
    """Every check (or those named), on ``corpus`` (default: :func:`sample_corpus` for the metric). Returns
    ``{check: "passed" | "skipped: <reason>"}``; raises one :class:`KitFailure` listing every failed check."""
    factory = as_factory(factory)
    if corpus is None:
        corpus = sample_corpus(factory().info)
    report, failures = {}, []
    for check in checks or CHECKS:
        try:
            run_check(check, factory, corpus, tolerance)
        except CheckSkipped as skip:
            report[check] = f"skipped: {skip}"
        except Exception as err:  # noqa: BLE001  (every check reports, not just the first)
            report[check] = "failed"
            failures.append(f"{check}: {type(err).__name__}: {err}")
        else:
            report[check] = "passed"
    if failures:
        raise KitFailure("the metric test kit found:\n  " + "\n  ".join(failures))
    return report


class MetricTests:
    """pytest tests of every check. Subclass it in a test file, as a class named ``Test...``, and set ``factory``
    (a metric class, a registered name, or a function of option overrides)::

        class TestWordPrecision(kit.MetricTests):
            factory = WordPrecision

    Override :meth:`corpus` to score your own samples, ``tolerance`` to loosen or tighten the comparisons.
    A check that does not apply is skipped, with the reason."""

    factory: ClassVar[Any] = None
    tolerance: ClassVar[Tolerance] = Tolerance()
    _corpora: ClassVar[dict[type, runner.Corpus]] = {}

    def make_factory(self) -> Factory:
        target = inspect.getattr_static(type(self), "factory")
        target = target.__func__ if isinstance(target, (staticmethod, classmethod)) else target
        if target is None:
            raise TypeError(f"{type(self).__name__}: set factory = <your metric class or a function of options>")
        return as_factory(target)

    def corpus(self) -> runner.Corpus:
        """The samples every check scores (default: :func:`sample_corpus`, built once per class)."""
        cls = type(self)
        if cls not in MetricTests._corpora:
            MetricTests._corpora[cls] = sample_corpus(self.make_factory()().info)
        return MetricTests._corpora[cls]

    def _check(self, check: str) -> None:
        import pytest

        try:
            run_check(check, self.make_factory(), self.corpus(), self.tolerance)
        except CheckSkipped as skip:
            pytest.skip(str(skip))

    def test_batch_split(self) -> None:
        self._check("batch_split")

    def test_ddp_merge(self) -> None:
        self._check("ddp_merge")

    def test_resume(self) -> None:
        self._check("resume")

    def test_empty_captions(self) -> None:
        self._check("empty_captions")

    def test_row_order(self) -> None:
        self._check("row_order")

    def test_card(self) -> None:
        self._check("card")

    def test_torchmetrics(self) -> None:
        self._check("torchmetrics")

    def test_evaluate(self) -> None:
        self._check("evaluate")

    def test_pycocoevalcap(self) -> None:
        self._check("pycocoevalcap")

    def test_lm_eval(self) -> None:
        self._check("lm_eval")
