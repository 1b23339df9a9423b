"""Redemption Score: the fusion of its registered parts (MID, DINO cycle similarity, BERTScore), checked
against the parts run on their own, plus its options, the torchmetrics path and real generation."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import random_image, words_metric
from test_generation import tiny_sd3  # noqa: F401  (the tiny Stable Diffusion 3 fixture)

import capeval_plugins
from capeval_plugins import registry
from capeval_plugins.contract import (
    DIGEST,
    GROUP,
    INDEX,
    CompositeMetric,
    Metric,
    MetricInfo,
    MetricResult,
    StateSpec,
    full_spec,
)
from capeval_plugins.testing import caption_corpus

needs_bertscore = pytest.mark.skipif("bertscore" not in registry.metrics(), reason="bertscore is not registered")

N = 40  # MID's fit on the tiny CLIP (16-dimensional features) needs more than 32 (image, reference) pairs


Words = words_metric()


class Centred(Metric):
    """Toy corpus part: caption length minus the corpus mean length (a "sum" state)."""

    info = MetricInfo(name="centred", display_name="Centred", description="", citation="", references="never",
                      images="never")

    def states(self):
        return {"total": StateSpec("sum", torch.float64, (2,)), "length": StateSpec("cat", torch.float64)}

    def map(self, batch):
        length = torch.tensor([float(len(c)) for c in batch.candidates], dtype=torch.float64)
        return {"total": torch.stack([length.sum(), torch.tensor(float(len(length)), dtype=torch.float64)]),
                "length": length}

    def finalize(self, state):
        centred = state["length"] - state["total"][0] / state["total"][1]
        return MetricResult(self.info.name, float(centred.mean()), centred, state[INDEX])


class Both(CompositeMetric):
    info = MetricInfo(name="both", display_name="Both", description="", citation="", references="never",
                      images="never")

    def components(self):
        return {"words": Words(batch_size=self.config.batch_size), "centred": Centred(batch_size=self.config.batch_size)}

    def combine(self, results, state):
        total = results["words"].scores + results["centred"].scores
        return MetricResult(self.info.name, float(total.mean()), total, state[INDEX],
                            extras={"chars": results["words"].extras["chars"]})


def test_a_composite_metric_keeps_each_part_s_state_and_result():
    texts = ["a b", "c", "d e f g", "hh ii", "j k l"]
    expected_words = [2, 1, 4, 2, 3]
    mean_length = sum(map(len, texts)) / len(texts)
    for batch_size in (1, 2, 64):
        result = Both(batch_size=batch_size)(None, texts)
        assert result.scores.tolist() == pytest.approx([w + len(t) - mean_length for w, t in zip(expected_words, texts)])
        assert result.extras["chars"].tolist() == [float(len(t)) for t in texts]
    assert set(full_spec(Both())) == {"words__score", "words__chars", "centred__total", "centred__length", INDEX, GROUP, DIGEST}
    assert full_spec(Both())["centred__total"].reduce == "sum"


def corpus(n: int = N):
    lines = caption_corpus(3 * n + 10, seed=5)
    images = [random_image(300 + i // 2, size=(30 + i % 3, 32)) for i in range(n)]  # two candidates per image
    candidates = [lines[i] for i in range(n)]
    references = [[lines[n + i // 2], lines[2 * n + i // 2]] for i in range(n)]
    return images, candidates, references


@pytest.fixture(scope="module")
def models(tiny_root) -> dict[str, str]:
    from capeval_plugins.testing import tiny_checkpoint

    return {kind: str(tiny_checkpoint(kind, root=tiny_root)) for kind in ("clip", "dino", "deberta_v3")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """Pre-generated images (a stand-in for Stable Diffusion 3) for every caption of the corpus."""
    root = tmp_path_factory.mktemp("generated")
    _, candidates, references = corpus()
    captions = list(dict.fromkeys(candidates + [r for refs in references for r in refs]))
    rows = []
    for i, caption in enumerate(captions):
        random_image(900 + i, size=(28, 28)).save(root / f"{i}.png")
        rows.append(json.dumps({"caption": caption, "image": f"{i}.png"}))
    (root / "index.jsonl").write_text("\n".join(rows) + "\n")
    return str(root)


def options(models, folder, **extra):
    return dict(clip_model=models["clip"], dino_model=models["dino"], generated_images=folder,
                bertscore_model=models["deberta_v3"], bertscore_num_layers=2, batch_size=6, **extra)


def parts(models, folder, data, covariance_eps=5e-4, **bert):
    """The three registered metrics run on their own (MID with Redemption's regulariser, its default)."""
    mid = registry.load("mid", model=models["clip"], covariance_eps=covariance_eps)(*data)
    dino = registry.load("dino_cycle", model=models["dino"], generated_images=folder)(*data)
    bertscore = registry.load("bertscore", model=models["deberta_v3"], num_layers=2, multi_reference="max",
                              **bert)(None, data[1], data[2])
    return mid, dino, bertscore


def eq9(p: np.ndarray) -> np.ndarray:
    return (p / (1 + np.abs(p)) + 1) / 2


@pytest.fixture(scope="module")
def direct(models, folder):
    return capeval_plugins.load("redemption_score", **options(models, folder))(*corpus())


@needs_bertscore
def test_the_score_is_the_weighted_sum_of_its_parts_run_alone(models, folder, direct):
    data, result = corpus(), direct
    mid_alone, dino_alone, bertscore_alone = parts(models, folder, data)
    mid, dino, bertscore = (p.scores.numpy() for p in (mid_alone, dino_alone, bertscore_alone))
    expected = 0.84 * eq9(mid) + 0.08 * dino + 0.08 * bertscore
    assert result.scores.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert result.score == pytest.approx(expected.mean(), abs=1e-5)
    extras = result.extras
    assert extras["mid_raw"].tolist() == pytest.approx(mid.tolist(), rel=1e-4, abs=1e-4)
    assert extras["mid_normalized"].tolist() == pytest.approx(eq9(mid).tolist(), abs=1e-5)
    assert extras["dino_raw"].tolist() == pytest.approx(dino.tolist(), abs=1e-6)
    assert torch.equal(extras["dino_raw"], extras["dino_normalized"])  # the paper fuses the raw cosine
    assert extras["bertscore_raw"].tolist() == pytest.approx(bertscore.tolist(), abs=1e-6)
    assert {"dino_s1", "dino_s2", "bertscore_precision", "bertscore_recall"} <= set(extras)
    # RS fuses the per-sample PMI; its "mid" extra is MID's corpus value (the official trace form by default)
    assert result.corpus_extras["mid"] == pytest.approx(mid_alone.score, rel=1e-4)
    assert abs(mid_alone.score - mid.mean()) > 1e-2


@needs_bertscore
def test_normalisations_weights_and_idf_reach_the_parts(models, folder):
    data = corpus()
    result = capeval_plugins.load("redemption_score", **options(
        models, folder, mid_weight=0.5, dino_weight=0.3, bertscore_weight=0.2, mid_normalization="none",
        dino_normalization="unit", bertscore_normalization="unit", bertscore_idf=True))(*data)
    mid, dino, bertscore = (p.scores.numpy() for p in parts(models, folder, data, idf=True))
    expected = 0.5 * mid + 0.3 * (dino + 1) / 2 + 0.2 * (bertscore + 1) / 2
    assert result.scores.tolist() == pytest.approx(expected.tolist(), rel=1e-4, abs=1e-4)
    mean = capeval_plugins.load("redemption_score", **options(models, folder, dino_weight=0.0, bertscore_weight=0.16,
                                                              mid_corpus_reduction="mean"))(*data)
    assert mean.corpus_extras["mid"] == pytest.approx(mid.mean(), rel=1e-4)  # the fused PMI does not change
    assert mean.extras["mid_raw"].tolist() == pytest.approx(mid.tolist(), rel=1e-4, abs=1e-4)


@needs_bertscore
def test_a_part_with_zero_weight_is_not_computed(models, folder):
    metric = capeval_plugins.load("redemption_score", **options(models, folder, mid_weight=0.0, dino_weight=0.5,
                                                                bertscore_weight=0.5))
    assert list(metric.components()) == ["dino", "bertscore"]
    images, candidates, references = corpus(6)  # no MID, so no minimum corpus size
    result = metric(images, candidates, references)
    assert not any(k.startswith("mid") for k in (*result.extras, *result.corpus_extras))
    expected = 0.5 * result.extras["dino_raw"] + 0.5 * result.extras["bertscore_raw"]
    assert result.scores.tolist() == pytest.approx(expected.tolist(), abs=1e-12)


@pytest.mark.parametrize("bad", [dict(mid_weight=0.5), dict(dino_weight=-0.1, bertscore_weight=0.26),
                                 dict(mid_normalization="minmax")])
def test_bad_options_are_refused(bad):
    with pytest.raises(ValueError, match="sum to 1|must be one of|dino_weight must be >= 0"):
        capeval_plugins.load("redemption_score", **bad)


@pytest.mark.parametrize("name", ["dino_cycle", "redemption_score"])
@pytest.mark.parametrize("unused", [dict(steps=1), dict(seed=123), dict(image_size=16), dict(cache=False),
                                    dict(generator_revision="main"), dict(cache_dir="/elsewhere")])
def test_generator_options_beside_a_folder_of_generated_images_are_refused(name, unused, tmp_path):
    """A folder of images made earlier replaces the generator: its options were accepted and changed nothing."""
    with pytest.raises(ValueError, match=f"{next(iter(unused))}: options of the generator, which generated_images"):
        capeval_plugins.load(name, generated_images=str(tmp_path), **unused)
    capeval_plugins.load(name, generated_images=str(tmp_path))  # the folder alone
    if "cache_dir" in unused:
        with pytest.raises(ValueError, match="cache=False caches none"):
            capeval_plugins.load(name, cache=False, **unused)


@needs_bertscore
def test_torchmetrics_batches_equal_one_call(models, folder, direct):
    from capeval_plugins.torchmetrics import RedemptionScore

    images, candidates, references = corpus()
    metric = RedemptionScore(**options(models, folder))
    for start in range(0, N, 11):
        metric.update(images[start:start + 11], candidates[start:start + 11], references[start:start + 11])
    result = metric.compute_all()
    assert tuple(metric.mid__fit_outer.shape) == (32, 32)  # MID's fit is still a summed state
    assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), rel=1e-4, abs=1e-4)


@needs_bertscore
def test_end_to_end_with_a_tiny_stable_diffusion_3(models, tmp_path, tiny_sd3):  # noqa: F811
    """The whole chain with real generation, on a corpus too small for an unregularised MID fit."""
    images, candidates, references = corpus(6)
    metric = capeval_plugins.load("redemption_score", clip_model=models["clip"], dino_model=models["dino"],
                                  generator=tiny_sd3, steps=2, image_size=32, cache_dir=str(tmp_path),
                                  bertscore_model=models["deberta_v3"], bertscore_num_layers=2, covariance_eps=1e-2,
                                  device="cpu")
    with pytest.warns(UserWarning, match="covariance is defined only through covariance_eps"):
        result = metric(images, candidates, references)
    extras = result.extras
    expected = 0.84 * extras["mid_normalized"] + 0.08 * extras["dino_raw"] + 0.08 * extras["bertscore_raw"]
    assert result.scores.tolist() == pytest.approx(expected.tolist(), abs=1e-12)
    assert bool(torch.isfinite(result.scores).all()) and len(list(tmp_path.rglob("*.png"))) == 9
    assert (extras["dino_raw"] == (extras["dino_s1"] + extras["dino_s2"]) / 2).all()


def test_every_option_of_every_part_is_an_option_of_the_composite_and_reaches_it():
    """Redemption's options are its parts' (flat, so `-o steps=20` works), derived from their configs: each part
    option appears once with the part's default (except where Redemption's configuration is the paper's or its
    code's: the models, BERTScore's layer, MID's covariance regulariser 5e-4) and a non-default value given to
    the composite reaches the part built from it."""
    import dataclasses

    from capeval_plugins.metrics.bertscore import BERTScoreConfig
    from capeval_plugins.metrics.dino_cycle import DinoCycleConfig
    from capeval_plugins.metrics.mid import MIDConfig
    from capeval_plugins.metrics.redemption import RedemptionConfig, RedemptionScore

    ours = {f.name: f for f in dataclasses.fields(RedemptionConfig)}
    # the names kept from before the options were derived; any other is <part>_<option>
    bare = {"mid": ("covariance_eps", "reference_gaussian", "fit_pairs"),
            "dino": ("generator", "generated_images", "cache", "cache_dir", "steps", "image_size", "guidance_scale",
                     "seed", "seed_per_caption", "generator_batch_size", "generator_dtype", "generator_revision",
                     "reference_choice"),
            "bertscore": ()}
    paper = {("mid", "covariance_eps"): 5e-4, ("mid", "preprocessing"): "transformers",
             ("bertscore", "model"): "microsoft/deberta-v3-large", ("bertscore", "num_layers"): 12}
    fixed = {("mid", "per_sample"): True, ("bertscore", "multi_reference"): "max"}
    shared = ("batch_size", "device", "dtype", "local_files_only", "device_map", "max_memory", "offload_folder")
    given, expected = {}, {}
    for part, config in (("mid", MIDConfig), ("dino", DinoCycleConfig), ("bertscore", BERTScoreConfig)):
        expected[part] = {}
        for field in dataclasses.fields(config):
            key = (part, field.name)
            if field.name == "on_error":
                continue
            if key in fixed:
                assert field.name not in ours and f"{part}_{field.name}" not in ours
                expected[part][field.name] = fixed[key]
                continue
            name = field.name if field.name in shared + bare[part] else f"{part}_{field.name}"
            name = {"mid_model": "clip_model"}.get(name, name)
            assert name in ours, (part, field.name)
            assert ours[name].default == paper.get(key, field.default), (part, field.name)
            assert ours[name].metadata == field.metadata, (part, field.name)
            if field.name not in shared and isinstance(field.default, (bool, int, float)) and field.name != "seed":
                value = (not field.default) if isinstance(field.default, bool) else field.default + 1
                if field.name in ("covariance_eps",):
                    value = 1e-3
                given[name] = value
            expected[part][field.name] = given.get(name, ours[name].default)
    metric = RedemptionScore(**given)
    for part, component in metric.components().items():
        got = dataclasses.asdict(component.config)
        got.pop("on_error")
        assert got == expected[part], part


def test_an_option_added_to_a_part_appears_on_the_composite():
    """A new option of a part (here a subclass of DINO-Cycle's config with one more) is an option of the
    composite at once, with its default and range, and goes back to the part."""
    import dataclasses

    from capeval_plugins.composite import Part, derive_config, part_options
    from capeval_plugins.contract import MetricConfig, bounded
    from capeval_plugins.metrics.dino_cycle import DinoCycleConfig

    @dataclasses.dataclass
    class Newer(DinoCycleConfig):
        crop_margin: int = bounded(3, ge=0)

    @dataclasses.dataclass
    class Own(MetricConfig):
        weight: float = 1.0

    parts = {"dino": Part(Newer, "dino_", names={"steps": "steps"})}
    shared = ("batch_size", "device")
    Config = derive_config("Config", Own, parts, shared, __name__)
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert fields["dino_crop_margin"].default == 3 and fields["dino_crop_margin"].metadata["bounds"] == {"ge": 0}
    assert "steps" in fields and "dino_steps" not in fields and "dino_on_error" not in fields
    config = Config(dino_crop_margin=5, steps=7, device="cpu")
    back = part_options(config, parts["dino"], shared)
    assert back["crop_margin"] == 5 and back["steps"] == 7 and back["device"] == "cpu" and "on_error" not in back
    with pytest.raises(TypeError, match="clashes"):
        derive_config("Config", Own, {"dino": Part(Newer, "", names={"steps": "weight"})}, shared, __name__)
    with pytest.raises(TypeError, match="no option"):
        derive_config("Config", Own, {"dino": Part(Newer, "dino_", fixed={"nope": 1})}, shared, __name__)


# --- the paper's fusion ablations (Tables 5 and 6) -----------------------------------------------------------


def fake_parts(seed: int = 0, n: int = 7) -> dict[str, MetricResult]:
    """Component results as the parts return them: MID's PMI (any sign), DINO and BERTScore similarities."""
    rng = np.random.default_rng(seed)
    raw = {"mid": rng.normal(0, 3, n), "dino": rng.uniform(-0.2, 1, n), "bertscore": rng.uniform(0.3, 0.9, n)}
    raw["dino"][0] = -0.1  # a negative similarity: the product is 0 there
    corpus = {"mid": {"mutual_information": 1.0}}
    return {name: MetricResult(name, float(v.mean()), torch.tensor(v), torch.arange(n),
                               corpus_extras=corpus.get(name, {})) for name, v in raw.items()}


def plain_fusion(parts, weights, multiplicative: bool) -> list[float]:
    """Eq. 10 or Eq. 11 written out per sample (MID through Eq. 9, the others as they are)."""
    out = []
    n = len(next(iter(parts.values())).scores)
    for i in range(n):
        values = {name: float(result.scores[i]) for name, result in parts.items()}
        if "mid" in values:
            p = values["mid"]
            values["mid"] = (p / (1 + abs(p)) + 1) / 2
        if multiplicative:
            total = 1.0
            for name, value in values.items():
                total *= max(value, 0.0) ** weights[name]
        else:
            total = sum(weights[name] * value for name, value in values.items())
        out.append(total)
    return out


@pytest.mark.parametrize("ablation", ["none", "multiplicative", "mid_bertscore", "mid_dino", "dino_bertscore"])
def test_fusion_ablations_equal_their_formulas(ablation):
    from capeval_plugins.metrics.redemption import ABLATIONS, RedemptionScore

    metric = RedemptionScore(ablation=ablation)
    weights = dict(zip(("mid", "dino", "bertscore"), ABLATIONS[ablation][0] if ablation != "none" else (0.84, 0.08, 0.08)))
    parts = {k: v for k, v in fake_parts().items() if weights[k] > 0}
    result = metric.combine(parts, {INDEX: torch.arange(7)})
    expected = plain_fusion(parts, weights, ablation == "multiplicative")
    assert result.scores.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert (ablation == "multiplicative") == (result.scores[0].item() == 0.0)  # its DINO similarity is < 0
    assert set(metric.components()) == {k for k, w in weights.items() if w > 0}


def test_multiplicative_fusion_with_chosen_weights_and_conflicts_refused():
    from capeval_plugins.metrics.redemption import RedemptionScore

    metric = RedemptionScore(fusion="multiplicative", mid_weight=0.5, dino_weight=0.25, bertscore_weight=0.25)
    parts = fake_parts(3)
    result = metric.combine(parts, {INDEX: torch.arange(7)})
    assert result.scores.tolist() == pytest.approx(
        plain_fusion(parts, {"mid": 0.5, "dino": 0.25, "bertscore": 0.25}, True), rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="ablation sets"):
        RedemptionScore(ablation="mid_dino", mid_weight=0.5, dino_weight=0.5, bertscore_weight=0.0)
    with pytest.raises(ValueError, match="fusion"):
        RedemptionScore(fusion="geometric")
    with pytest.raises(ValueError, match="ablation"):
        RedemptionScore(ablation="lpips")
