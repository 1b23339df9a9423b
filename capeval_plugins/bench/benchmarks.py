"""The benchmarks ``capeval bench`` knows, by the names scripts rely on, with the protocol each expects."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from capeval_plugins.core.messages import UnknownName, unknown_name

if TYPE_CHECKING:
    from capeval_plugins.bench.data import Pairs, Ratings


@dataclass(frozen=True)
class Protocol:
    """How a benchmark is judged. ``kind="correlation"``: Kendall tau-b, tau-c, Pearson and Spearman between
    metric and human scores over all rows (against each human column; ``average_columns``: also their mean),
    ``primary`` the one papers report. ``kind="pairwise"``: share of pairs where the metric prefers the caption
    humans preferred, per category, per ``category_groups`` (mean of their categories) and the mean of all
    categories when ``mean`` is set. ``ties`` is the official script's convention for a tied metric score
    (``--ties`` overrides) and ``tie_margin`` the score difference up to which two scores are a metric tie
    (``--tie-margin`` overrides); ``human_ties``: pairs humans judged a tie are ``"count"``-ed (right only where the
    metric predicts a tie) or ``"skip"``-ped; ``round_scores`` rounds metric scores first, as an official script
    does. ``graded_rule`` judges graded preferences (DOCENT): ``"posh"`` (three classes, PoSh's script) or
    ``"binary"`` (MSD-Score's script). ``elo`` is the model-level procedure (see :mod:`.ranking`),
    ``shuffle_rounds`` the passes its single-pass form averages (``--shuffle-rounds`` overrides) and ``unranked``
    the systems left out of both rankings."""

    kind: str
    primary: str
    description: str
    categories: tuple[str, ...] = ()
    mean: bool = True
    ties: str = "wrong"
    category_groups: Mapping[str, tuple[str, ...]] | None = None
    average_columns: bool = False
    round_scores: int | None = None
    table_stats: tuple[str, ...] = ()  # the statistics the printed table shows (all in the JSON); () = all
    pooled: bool = False  # pairwise "accuracy": share over all pairs instead of the mean over categories
    # model-level ranking: human ranking of the systems, best first (CapArena's official list), or () to rank
    # them by the human votes; None: no model-level figure
    model_ranking: tuple[str, ...] | None = None
    tie_margin: float | str = 0.0
    human_ties: str = "count"
    graded_rule: str = "posh"
    elo: str = "bootstrap"
    shuffle_rounds: int = 1
    unranked: tuple[str, ...] = ()

    def headline(self) -> tuple[str, ...]:
        """The statistics compared between metrics (significance tests)."""
        if self.kind == "correlation" or self.primary != "accuracy":
            return (self.primary,)
        return ("accuracy",) if self.mean else tuple(f"category:{c}" for c in self.categories)


@dataclass(frozen=True)
class Variant:
    """Another protocol for a benchmark (a paper's own evaluation script), chosen by name (``--protocol``):
    its :class:`Protocol` and, where it reads the file differently, its reader."""

    protocol: Protocol
    reader: Callable[[Path], "Ratings | Pairs"] | None = None
    source: str = ""


OFFICIAL = "official"


Scale = tuple[float, float]


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    protocol: Protocol
    reader: Callable[[Path], "Ratings | Pairs"]
    data_format: str
    # The scale its human scores are published on, (lowest, highest), or one per human column where they differ
    # (FactVC); None: judgments that are labels, not scores (pairwise benchmarks). A score outside it (or not a
    # number) is refused with the row that holds it: one such score moves every correlation.
    human_scale: Scale | Mapping[str, Scale] | None = None
    # More rows than its published files hold, with room to spare: a file with more is refused before it is read
    # whole (a 230 KB Parquet file of 1,000,000 repeated rows decodes into GBs).
    max_rows: int = 200_000
    # Options a metric gets on this benchmark unless the user sets them (``-o``), e.g. the settings of the
    # benchmark's official script: {"msd_score": {"preset": "sugarcrepe"}}. Applied by ``capeval bench`` and
    # :func:`metric_options`; a metric whose Config lacks the key is left as it is.
    metric_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    source: str = ""
    # Other protocols by name; the benchmark's own official protocol is "official" (the default).
    variants: Mapping[str, Variant] = field(default_factory=dict)
    variant: str = OFFICIAL

    def read(self, path: str | Path) -> "Ratings | Pairs":
        """The benchmark's file read, within its row bound, its human scores checked against its scale."""
        from capeval_plugins.bench.readers import row_limit

        with row_limit(self.max_rows, self.title):
            data = self.reader(Path(path))
        self.check(data, str(path))
        return data

    def scale(self, column: str = "human") -> Scale | None:
        """The scale of the human column ``column`` (None: not declared)."""
        if isinstance(self.human_scale, Mapping):
            return self.human_scale.get(column)
        return self.human_scale

    def check(self, data: "Ratings | Pairs", source: str = "") -> None:
        """Refuse ``data`` with more rows than the benchmark has by far, or a human score outside its scale (or not
        a number), naming the row; NaN judgments a reader skips by protocol never get here."""
        import numpy as np

        from capeval_plugins.bench.data import Ratings
        from capeval_plugins.inputs import InputError

        where = f"{source}: " if source else ""
        if len(data.captions) > self.max_rows:
            raise InputError(f"{where}{len(data.captions):,} rows, more than {self.title} has by far (at most "
                             f"{self.max_rows:,})")
        if not isinstance(data, Ratings):
            return
        for column, values in data.human_columns().items():
            scale = self.scale(column)
            if scale is None:
                continue
            low, high = scale
            outside = np.flatnonzero(~((values >= low) & (values <= high)))  # NaN is outside too
            if len(outside):
                row = int(outside[0])
                named = "" if column == "human" else f" ({column})"
                raise InputError(
                    f"{where}row {row} (image {data.captions.image_keys()[row][:60]!r}): human score{named} "
                    f"{float(values[row])!r} is outside {self.title}'s scale [{low:g}, {high:g}] ({len(outside):,} "
                    f"of {len(values):,} rows are); such a score would move every correlation: fix the file, or give "
                    "the scale it is on with --human-scale LOW,HIGH")

    def with_scale(self, scale: Scale | None) -> "Benchmark":
        """This benchmark with its human scores on ``scale`` instead of the published one (None: as it is)."""
        from capeval_plugins.inputs import InputError

        if scale is None:
            return self
        low, high = (float(v) for v in scale)
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise InputError(f"--human-scale needs two finite numbers LOW < HIGH, got {low:g}, {high:g}")
        if isinstance(self.human_scale, Mapping) and len(self.human_scale) > 1:
            raise InputError(f"--human-scale sets one scale; {self.title} has several human columns "
                             f"({', '.join(self.human_scale)})")
        return replace(self, human_scale=(low, high))

    def protocols(self) -> list[str]:
        return [OFFICIAL, *self.variants]

    def with_protocol(self, name: str | None) -> "Benchmark":
        """This benchmark judged by the protocol ``name`` ("official": its own; None: as it is)."""
        if name is None or name == self.variant:
            return self
        official = self if self.variant == OFFICIAL else BENCHMARKS[self.name]
        if name == OFFICIAL:
            return official
        if name not in official.variants:
            raise UnknownName(f"{self.name} has no protocol {name!r}; known: {official.protocols()}")
        v = official.variants[name]
        return replace(official, protocol=v.protocol, reader=v.reader or official.reader,
                       source=v.source or official.source, variant=name)


def _reader(name: str, *args: Any) -> Callable[[Path], "Ratings | Pairs"]:
    """A reader of :mod:`capeval_plugins.bench.readers`, imported when a file is read (so listing the
    benchmarks, as the ``capeval`` parser does, imports nothing heavy)."""

    def read(path: Path) -> "Ratings | Pairs":
        from capeval_plugins.bench import readers

        return getattr(readers, name)(path, *args)

    return read


# The human ranking CapArena's official model-level script compares with (best first).
CAPARENA_HUMAN_RANKING = (
    "GPT-4o-0806", "human", "Gemini-2.0-flash-exp", "InternVL2-26B", "Gemini-1.5-pro-002", "Claude-3.5-Sonnet-0620",
    "GPT-4o-mini-0718", "LLama-3.2-90B", "Qwen2-VL-72B-Instruct", "CogVLM2-llama3-chat-19B", "MiniCPM-V2.6-8B",
    "Qwen2-VL-7B-Instruct", "Qwen2-VL-2B-Instruct", "LLaVA-1.6-34B", "LLaVA-1.5-7B")

# MSD-Score's official settings for short captions, applied where the metric's Config has the option and the user
# did not set it: the SugarCrepe scripts' (4 image, 2 text components) and coco_eval_cf.py's (3 and 2, its EM).
SUGARCREPE_MSD = {"msd_score": {"preset": "sugarcrepe"}, "soft_msd": {"preset": "sugarcrepe"}}
COCO_CF_MSD = {"msd_score": {"preset": "coco-cf"}, "soft_msd": {"preset": "coco-cf"}}
# Its settings for long captions: the CapArena and DOCENT scripts fit 5 image and 3 text components (the paper's
# "long" regime), whichever protocol judges the scores.
LONG_CAPTION_MSD = {"msd_score": {"setting": "long"}, "soft_msd": {"setting": "long"}}
MSD_SCRIPTS = "SteinsGateSg/MSDScore metrics/vMF_MSD_Score/"
CAPARENA_LEVELS = ("level 1", "level 2", "level 3", "level 4")

# MSD-Score's own protocols (its official scripts), for its Tables III (CapArena) and IV (DOCENT).
MSD_CAPARENA = Variant(
    Protocol("pairwise", "accuracy",
             "MSD-Score's protocol (its caparena.py; the paper's Table III): caption-level agreement (x100) over the "
             "battles humans did not tie, the human source included (battles whose winner is neither a source nor "
             "'tie' left out, as the script skips them); the metric's decision is a tie when the two "
             "scores are within 1e-4 (then wrong); share over those battles and per level; model level: Spearman / "
             "Kendall tau-b between the models' positions in the Elo ranking from the metric's decisions and in the "
             "Elo ranking from the human votes (a tie half a win each), one pass over every battle in the order "
             "Python's random.Random(1234) shuffles them, K = 32 (--shuffle-rounds R: R passes from fresh ratings, "
             "pass r shuffled by random.Random(1234 + r), ratings averaged; the script's default is 1, its README "
             "runs 5), the human source left out of both rankings",
             categories=CAPARENA_LEVELS, ties="wrong", pooled=True, model_ranking=(), tie_margin=1e-4,
             human_ties="skip", elo="single", unranked=("human",)),
    reader=_reader("read_caparena", True, ("tie",)), source="MSD-Score (Table III); " + MSD_SCRIPTS + "caparena.py")
MSD_DOCENT = Variant(
    Protocol("pairwise", "accuracy:overall_quality",
             "MSD-Score's protocol (its docent.py; the paper's Table IV): per judgment type, binary accuracy (x100) "
             "over the pairs humans did not judge equal, right when the score difference (first minus second) is "
             "> 0 exactly where humans preferred the first caption (a zero difference counts as preferring the "
             "second, as the script's test does); Kendall tau-b, Spearman and Pearson (x100) between the 5-level "
             "label (+2 .. -2) and the score difference over all pairs (the script reports overall quality; the same "
             "rule is applied to mistakes and omissions)", mean=False, graded_rule="binary"),
    source="MSD-Score (Table IV); " + MSD_SCRIPTS + "docent.py")

_CORRELATION = ("Kendall tau between metric scores and human scores over all rows (scipy's definition; "
                "x100), corpus-level metrics scored on all rows in one call")

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("flickr8k-expert", "Flickr8k-Expert",
              Protocol("correlation", "kendall_tau_c",
                       _CORRELATION + "; one row per expert rating (three per caption, not averaged); candidates "
                       "identical to a reference of their image excluded; tau-c as reported by CLIPScore / PAC-S"),
              _reader("read_judgement_json", "drop_rows"), "CLIPScore / PAC-S json (flickr8k.json)"),
    Benchmark("flickr8k-cf", "Flickr8k-CF",
              Protocol("correlation", "kendall_tau_b",
                       _CORRELATION + "; one row per image-caption pair with the share of 'yes' judgements; judged "
                       "candidates removed from their image's references; tau-b as reported by CLIPScore / PAC-S"),
              _reader("read_judgement_json", "drop_references"),
              "CLIPScore / PAC-S json (crowdflower_flickr8k.json)"),
    Benchmark("composite", "Composite",
              Protocol("correlation", "kendall_tau_c",
                       _CORRELATION + "; candidates identical to a reference excluded; tau-c"),
              _reader("read_composite"), "CLIPScore json, or FLEUR / EXPERT composite.json"),
    Benchmark("pascal50s", "Pascal-50S",
              Protocol("pairwise", "accuracy",
                       "accuracy (x100) per category (HC, HI, HM, MM) and their mean: the metric is right when it "
                       "scores the caption humans preferred strictly higher; both captions of every pair scored "
                       "in one call", categories=("HC", "HI", "HM", "MM")),
              _reader("read_pairwise", ("HC", "HI", "HM", "MM")), "FLEUR / EXPERT pascal_50s.json"),
    Benchmark("foil", "FOIL",
              Protocol("pairwise", "accuracy",
                       "accuracy (x100) of preferring the original caption over its foil, with one reference "
                       "(1-ref) and four references (4-ref), each setting scored as its own corpus",
                       categories=("1-ref", "4-ref"), mean=False),
              _reader("read_foil"), "FOIL-COCO foilv1.0_test_2017.json + COCO captions_val2014.json"),
    Benchmark("nebula", "Nebula",
              Protocol("correlation", "kendall_tau_c", _CORRELATION + "; tau-c"),
              _reader("read_rated_rows"), "EXPERT nebula_test.json (imgid, mt, refs, score)"),
    Benchmark("polaris", "Polaris",
              Protocol("correlation", "kendall_tau_c", _CORRELATION + "; tau-c as Polos reports it"),
              _reader("read_rated_rows"), "Polos polaris_test.csv, EXPERT polaris_test.json or HF Parquet"),
    Benchmark("thumb", "THumB 1.0 (COCO)",
              Protocol("correlation", "kendall_tau_c", _CORRELATION + "; human_score = (P + R) / 2 + penalties; tau-c"),
              _reader("read_thumb"), "THumB mscoco_THumB-1.0.jsonl + mscoco_references.json"),
    Benchmark("sugarcrepe", "SugarCrepe",
              Protocol("pairwise", "accuracy",
                       "accuracy (x100) per subset: the metric is right when it scores the positive caption "
                       "strictly higher than the hard negative (a tie is wrong, as the official script counts "
                       "it); Replace / Swap / Add = mean of their subsets, as MSD-Score groups them; both captions "
                       "of a pair form one group for group metrics",
                       categories=("replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att", "add_obj",
                                   "add_att"),
                       category_groups={"Replace": ("replace_obj", "replace_att", "replace_rel"),
                                        "Swap": ("swap_obj", "swap_att"), "Add": ("add_obj", "add_att")}),
              _reader("read_sugarcrepe"), "RAIVNLab/sugar-crepe data/ folder (7 json files) or one subset file",
              metric_defaults=SUGARCREPE_MSD, source="Hsieh et al., NeurIPS 2023; RAIVNLab/sugar-crepe"),
    Benchmark("coco-cf", "COCO-CF",
              Protocol("pairwise", "accuracy",
                       "accuracy (x100) per perturbation type and their mean: the metric is right when it scores "
                       "the faithful caption strictly higher than its counterfactual (a tie is wrong); both "
                       "captions of a pair form one group for group metrics"),
              _reader("read_counterfactual"),
              "not public: coco_eval_cf.py's json (a list of {image_path, caption, negative_caption}, one file per "
              "split), SugarCrepe's layout (one json per perturbation) or the generic pairwise format",
              metric_defaults=COCO_CF_MSD,
              source="MSD-Score (Sec. 4.1); " + MSD_SCRIPTS + "coco_eval_cf.py; the data files are not public"),
    Benchmark("activitynet-fact", "ActivityNet-Fact",
              Protocol("correlation", "pearson:paragraph",
                       "Pearson r (x100; Kendall and Spearman also reported) against the paragraph score and the "
                       "negated sentence- and word-level hallucination rates, one row per (video, model) "
                       "paragraph, model-major over vids.txt, text kept as lower-case letters (FactVC's script); "
                       "system level over the 6 models", table_stats=("pearson", "spearman")),
              _reader("read_factvc", "activitynet"), "FactVC data/activitynet folder",
              source="Liu and Wan, 2023 (FactVC); PKULiuHui/FactVC metric/factvc_corr.py"),
    Benchmark("youcook2-fact", "YouCook2-Fact",
              Protocol("correlation", "pearson:paragraph",
                       "Pearson r (x100) against the paragraph score and the negated sentence- and word-level "
                       "hallucination rates, model-major over vids.txt, FactVC's text normalisation; system level "
                       "over the 6 models", table_stats=("pearson", "spearman")),
              _reader("read_factvc", "youcook2"), "FactVC data/youcook2 folder",
              source="Liu and Wan, 2023 (FactVC); PKULiuHui/FactVC metric/factvc_corr.py"),
    Benchmark("vatex-eval", "VATEX-EVAL",
              Protocol("correlation", "kendall_tau_b",
                       "Kendall tau-b and Spearman rho (x100) against each of the 3 annotators' ratings, then "
                       "their mean (EMScore's protocol), metric scores rounded to 4 decimals; references: the "
                       "first --num-references of 9 (EMScore reports 1 and 9; 0 for reference-free)",
                       average_columns=True, round_scores=4, table_stats=("kendall_tau_b", "spearman")),
              _reader("read_vatex_eval"), "VATEX-EVAL vid_cans_score_dict.json",
              source="Shi et al., 2022 (EMScore); ShiYaya/emscore"),
    Benchmark("activitynet-foil", "ActivityNet-FOIL",
              Protocol("pairwise", "accuracy",
                       "accuracy (x100) of scoring a video's right paragraph strictly higher than its foiled one, "
                       "a paragraph's score the mean over its sentences, each sentence scored against its own "
                       "video segment and the references it overlaps by more than 40 % (EMScore's protocol)"),
              _reader("read_activitynet_foil"), "EMScore's ActivityNet-FOIL storage folder",
              source="Shi et al., 2022 (EMScore); ShiYaya/emscore ActivityNet-FOIL_demo.py"),
    Benchmark("caparena", "CapArena",
              Protocol("pairwise", "accuracy",
                       "caption-level agreement (x100) with the human vote, ties included (the official script): "
                       "the metric's decision is the caption it scores higher, equal scores predict a tie "
                       "(--tie-margin D: scores within D, MSD-Score's reading); share over all battles and per "
                       "level; model level: Spearman / Kendall tau-b between the models' bootstrap-Elo ranking "
                       "from the metric's decisions and the official human ranking; battles with the human "
                       "source left out", categories=CAPARENA_LEVELS,
                       ties="tie", pooled=True, model_ranking=CAPARENA_HUMAN_RANKING),
              _reader("read_caparena"), "CapArena caparena_annots_eval.json (list of battles)",
              metric_defaults=LONG_CAPTION_MSD, variants={"msd-score": MSD_CAPARENA},
              source="Cheng et al., 2025 (CapArena); njucckevin/CapArena caparena_metrics.py, cal_ranking.py"),
    Benchmark("docent", "DOCENT",
              Protocol("pairwise", "accuracy:overall_quality",
                       "per judgment type (mistakes, omissions, overall quality): accuracy (x100) over three "
                       "classes (first better, equal, second better), the metric predicting 'equal' below a score "
                       "difference calibrated to the number of human ties, and Spearman / Kendall tau-b between "
                       "the 5-level human preference and the score difference (PoSh's official script)",
                       mean=False),
              _reader("read_docent"), "Hugging Face amitha/docent-eval-coarse (test split) as Parquet / JSON",
              metric_defaults=LONG_CAPTION_MSD, variants={"msd-score": MSD_DOCENT},
              source="Ananthram et al., 2025 (PoSh, DOCENT); amith-ananthram/posh evaluate_posh_coarse.py"),
    Benchmark("mceval", "MCEval",
              Protocol("pairwise", "accuracy",
                       "accuracy (x100) per visual domain and their mean (DISCODE's MCEval protocol): the metric "
                       "is right when it scores the preferred caption strictly higher"),
              _reader("read_pairwise"), "generic pairwise JSON / JSON Lines (category = domain)"),
)}


# LongCap-Arena (Matsuda et al., EMNLP 2025, with VELA): long candidate captions of DCI images, each judged by
# humans for one aspect at a time. Test A is the Hub's ``dci_val`` split, Test B its ``dci_test`` (CaptionEvalKit's
# naming); one benchmark per (test set, aspect), as the paper reports them.
LONGCAP_ARENA_ASPECTS = {"desc": "Descriptiveness", "rel": "Relevance", "flu": "Fluency"}
LONGCAP_ARENA_SPLITS = {"testa": "dci_val", "testb": "dci_test"}


def _longcap_arena(test: str, aspect: str) -> Benchmark:
    label = f"LongCap-Arena Test{test[-1].upper()} {LONGCAP_ARENA_ASPECTS[aspect]}"
    return Benchmark(
        f"longcaparena-{test}-{aspect}", label,
        Protocol("correlation", "kendall_tau_b",
                 _CORRELATION + f"; one row per judged long caption ({LONGCAP_ARENA_ASPECTS[aspect]} score in "
                 "[0, 1]); tau-b and tau-c as VELA reports them (its Table 1 and Appendix D Table 4)"),
        _reader("read_rated_rows"),
        f"Hugging Face Ka2ukiMatsuda/LongCap-Arena split {LONGCAP_ARENA_SPLITS[test]}.{aspect} as Parquet (file_name, "
        "image, refs, cand, score), or its rows as CSV / JSON (imgid, cand, refs, score)",
        metric_defaults={**LONG_CAPTION_MSD, "vela": {"aspect": aspect}},  # VELA scores the judged aspect
        source="Matsuda et al., EMNLP 2025 (VELA, LongCap-Arena); Ka2ukiMatsuda/VELA")


BENCHMARKS.update((b.name, b) for b in (_longcap_arena(t, a) for t in LONGCAP_ARENA_SPLITS
                                         for a in LONGCAP_ARENA_ASPECTS))


# The scale each rating benchmark's human scores are on, as its public files hold them (checked on every read and
# on every label set applied; ``capeval bench --human-scale`` names another).
FACTVC_SCALE = {"paragraph": (1.0, 5.0), "sentence": (-1.0, 0.0), "word": (-1.0, 0.0)}  # negated hallucination rates
HUMAN_SCALES: dict[str, Scale | Mapping[str, Scale]] = {
    "flickr8k-expert": (1.0, 4.0),  # expert ratings 1-4 (Hodosh et al., 2013)
    "flickr8k-cf": (0.0, 1.0),  # the share of CrowdFlower "yes" votes
    "composite": (1.0, 5.0),  # AMT ratings 1-5 (Aditya et al., 2015)
    "nebula": (0.0, 1.0),  # ratings normalised to [0, 1]; Spica's corrections are on the same scale
    "polaris": (0.0, 1.0),  # ratings normalised to [0, 1]
    "thumb": (-0.5, 5.0),  # (P + R) / 2, P and R 1-5, minus the fluency, conciseness, inclusiveness penalties (<= 0.5)
    "activitynet-fact": FACTVC_SCALE, "youcook2-fact": FACTVC_SCALE,
    "vatex-eval": (1.0, 5.0),  # each annotator's rating 1-5
    **{name: (0.0, 1.0) for name in BENCHMARKS if name.startswith("longcaparena-")},  # aspect scores in [0, 1]
}
# Row bounds above the default 200,000 (every benchmark's published split is a quarter of its bound or less).
MAX_ROWS = {
    "flickr8k-cf": 500_000,  # 47,830 rated pairs (145k votes)
    "polaris": 500_000,  # 131,020 rows over its splits
    "foil": 4_000_000,  # up to ~200k FOIL-COCO pairs, two rows a pair in each of two settings
    "coco-cf": 2_000_000,  # not public: unknown
    "mceval": 2_000_000,  # a generic pairwise format
    "activitynet-foil": 1_000_000,  # one row a sentence of every paragraph
}
BENCHMARKS.update((name, replace(b, human_scale=HUMAN_SCALES.get(name), max_rows=MAX_ROWS.get(name, b.max_rows)))
                  for name, b in list(BENCHMARKS.items()))


def benchmark_names() -> list[str]:
    return list(BENCHMARKS)


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise unknown_name("benchmark", name, benchmark_names())
    return BENCHMARKS[name]


def load_benchmark(name: str, path: str | Path) -> "Ratings | Pairs":
    """Read a benchmark's file (or folder) with its reader."""
    return get_benchmark(name).read(path)


def metric_options(benchmark: str | Benchmark, names: Sequence[str], options: Sequence[str]) -> list[str]:
    """``options`` (``[metric.]key=value`` strings) with the benchmark's ``metric_defaults`` added for every
    selected metric that takes the key and for which the user set no value (``metric.key=`` or bare ``key=``).
    Defaults come first, so ``capeval score``'s option rules apply unchanged."""
    from capeval_plugins import registry
    from capeval_plugins.options import fields

    bench = benchmark if isinstance(benchmark, Benchmark) else get_benchmark(benchmark)
    given = {pair.partition("=")[0].strip().replace("-", "_") for pair in options}
    added = []
    for name in names:
        entry = registry.get(name)
        canonical = entry.info.name
        defaults = bench.metric_defaults.get(canonical, {})
        known = fields(entry.cls.Config) if defaults else {}
        for key, value in defaults.items():
            if key in known and not given & {key, f"{name}.{key}", f"{canonical}.{key}"}:
                added.append(f"{canonical}.{key}={value}")
    return added + list(options)
