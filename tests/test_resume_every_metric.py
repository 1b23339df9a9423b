"""Resume is bit-identical for every metric: a run of every metric that runs on a CPU with tiny models (image,
text, corpus, group, composite and LVLM metrics, and the Java ones where Java is installed), interrupted part-way
and run again from its run folder, ends with the same bits as an uninterrupted run. A sample's score must not
depend on which other samples were still to do (BERTScore's corpus preparation once did).

A metric of a plugin installed beside the package is run by the metric test kit's resume check
(``capeval_plugins.testing.kit.check_resume``) on the tiny recipe it declares (``Metric.tiny_recipe``); one that
declares none is skipped, saying so.

The runs are in this process, one metric family per test (the metrics of a family share their backbones, loaded
once): the interruption stops after a chosen batch of the runner's own plan (``runner.schedule``). The command
line's real SIGINT and its output bytes are tests/test_cli.py's (test_an_interrupted_run_resumes_to_the_same_bits).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import StopAfter, declared_recipe, has_java, random_image, third_party_metrics
from test_lvlm import scripted_llava, sharp_llava

from capeval_plugins import registry
from capeval_plugins.core.arrays import host
from capeval_plugins.testing import scratch_folder
from capeval_plugins.testing.corpus import caption_corpus

N_IMAGES = 21  # MID's fit on the tiny CLIP (16-dimensional features) needs more than 32 (image, reference) pairs


def rigel_checkpoint(llava_next: str) -> str:
    """A Rigel checkpoint on the tiny LLaVA-NeXT (random head, phase 1 format), as tests/test_rigel_metric.py."""
    from capeval_plugins.models.rigel import RigelSettings
    from capeval_plugins.training.checkpoint import save_checkpoint

    settings = RigelSettings(base_model=llava_next, hidden_size=32, head_hidden=(16,), phase=1)
    torch.manual_seed(0)
    return str(save_checkpoint(str(scratch_folder("capeval-rigel-ckpt-")), settings, settings.build_head()))


def write_corpus(root: Path) -> tuple[Path, Path]:
    """A caption file (two candidates per image, two references each), its images, and the images drawn for
    every caption in advance (the stand-in for Stable Diffusion 3 of DINO-cycle and Redemption Score)."""
    lines = caption_corpus(4 * N_IMAGES + 10, seed=11)
    rows = []
    (root / "images").mkdir()
    for i in range(N_IMAGES):
        random_image(500 + i, size=(40 + i % 5, 36)).save(root / "images" / f"{i}.png")
        refs = [lines[2 * N_IMAGES + i], lines[3 * N_IMAGES + i]]
        rows += [{"image": f"images/{i}.png", "caption": lines[2 * i + k], "references": refs} for k in range(2)]
    captions = root / "captions.jsonl"
    captions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = root / "generated"
    drawn.mkdir()
    texts = list(dict.fromkeys([r["caption"] for r in rows] + [x for r in rows for x in r["references"]]))
    index = []
    for i, text in enumerate(texts):
        random_image(900 + i, size=(28, 28)).save(drawn / f"{i}.png")
        index.append(json.dumps({"caption": text, "image": f"{i}.png"}))
    (drawn / "index.jsonl").write_text("\n".join(index) + "\n")
    return captions, drawn


FAMILIES = {
    "clip": ["clipscore", "refclipscore", "mid", "msd_score", "soft_msd"],
    "text": ["bertscore", "bleu4", "rouge_l", "cider", "meteor"],
    "judges": ["fleur", "discode", "rigel", "expert"],
    "pacs_and_polos": ["pacscore", "refpacscore", "pacscore_pp", "refpacscore_pp", "polos", "vela"],
    "regions_and_cycles": ["vilbertscore", "dino_cycle", "redemption_score"],
}


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("resume-corpus"))


def options_of(family: list[str], tiny_root, drawn: Path) -> dict[str, dict]:
    from capeval_plugins.testing import tiny_checkpoint

    model = lambda kind: str(tiny_checkpoint(kind, root=tiny_root))  # noqa: E731
    every = {
        "clipscore": lambda: {"model": model("clip")}, "refclipscore": lambda: {"model": model("clip")},
        "mid": lambda: {"model": model("clip")}, "msd_score": lambda: {"model": model("clip")},
        "soft_msd": lambda: {"model": model("clip")},
        "bertscore": lambda: {"model": model("roberta"), "batch_size": 4},  # texts embedded in chunks of 4
        "bleu4": lambda: {}, "rouge_l": lambda: {}, "cider": lambda: {}, "meteor": lambda: {},
        # writes a score: FLEUR and DISCODE have numbers (the same for every sample: its layers add nothing);
        # Rigel reads a random, image-dependent one
        "fleur": lambda: {"model": scripted_llava(JUDGE)}, "discode": lambda: {"model": scripted_llava(JUDGE)},
        "rigel": lambda: {"checkpoint": rigel_checkpoint(sharp_llava())},
        # EXPERT's conversation ends "###Assistant:"; its answer "0.8" then the end of sequence
        "expert": lambda: {"model": scripted_llava(EXPERT_JUDGE), "max_new_tokens": 8},
        "vilbertscore": lambda: {"model": model("vilt")},
        "pacscore": lambda: {"model": model("pacs")}, "refpacscore": lambda: {"model": model("pacs")},
        "pacscore_pp": lambda: {"model": model("pacs_pp")}, "refpacscore_pp": lambda: {"model": model("pacs_pp")},
        "polos": lambda: {"model": model("polos")}, "vela": lambda: {"model": model("vela")},
        "dino_cycle": lambda: {"model": model("dino"), "generated_images": str(drawn)},
        "redemption_score": lambda: {"clip_model": model("clip"), "dino_model": model("dino"),
                                     "generated_images": str(drawn), "bertscore_model": model("deberta_v3"),
                                     "bertscore_num_layers": 2},
    }
    chosen = {}
    for name in family:
        if name == "meteor" and not has_java():
            continue
        options = {"batch_size": 8, **every[name]()}
        if name in ("bleu4", "rouge_l", "cider") and not has_java():  # PTB tokenisation runs Java
            options["tokenize"] = False
        chosen[name] = options
    return chosen


JUDGE = ("▁[/INST]", "▁", "0", ".", "8", "A", "▁dog")
EXPERT_JUDGE = (":", "▁", "0", ".", "8", "</s>")


def same_bits(a, b) -> bool:
    """Equal kind (array or tensor), shape, dtype and bits, NaN equal to NaN."""
    from capeval_plugins.testing.kit import same_bits as kit_same_bits

    return kit_same_bits(a, b)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_metric_resumes_to_the_same_bits(family, tiny_root, corpus_files, tmp_path):
    import capeval_plugins
    from capeval_plugins import runner

    captions, drawn = corpus_files
    rows = [json.loads(line) for line in captions.read_text().splitlines()]
    corpus = runner.Corpus([r["caption"] for r in rows], [str(captions.parent / r["image"]) for r in rows],
                           [r["references"] for r in rows])
    options = options_of(FAMILIES[family], tiny_root, drawn)
    build = lambda: {name: capeval_plugins.load(name, **opts) for name, opts in options.items()}  # noqa: E731
    session = runner.Session(build())
    valid = session.validate(corpus)
    for name, samples in valid.items():  # the runner probes others' metrics, the suite ours
        runner.check_row_order(session.metrics[name], session.batches(name, samples[0])[0], session.cache, strict=True)
    whole = runner.run(build(), corpus).results
    # the runner's plan: stop after BERTScore's 6th of 11 batches (its texts embedded in chunks of 4 then differ,
    # on this corpus, from those of the whole pass in the last bits on the tiny RoBERTa), elsewhere half-way
    plan = runner.schedule({name: len(session.batches(name, valid[name][0])) for name in options})
    stop = plan.index(("bertscore", 5)) + 1 if ("bertscore", 5) in plan else len(plan) // 2
    folder = tmp_path / "run"
    with pytest.raises(runner.Interrupted, match=f"interrupted after {stop} of {len(plan)} batches"):
        runner.run(build(), corpus, run_dir=folder, stop=StopAfter(stop))
    resumed = runner.run(build(), corpus, run_dir=folder)
    assert resumed.batches_resumed == stop and resumed.batches_scored == len(plan) - stop
    for name, result in whole.items():
        again = resumed.results[name]
        assert same_bits(result.scores, again.scores), name
        assert result.extras.keys() == again.extras.keys() and all(
            v == again.extras[k] if isinstance(v, list) else same_bits(v, again.extras[k])  # texts, or tensors
            for k, v in result.extras.items()), name
        assert result.corpus_extras == again.corpus_extras or str(result.corpus_extras) == str(again.corpus_extras)
        assert (result.score == again.score) or (math.isnan(result.score) and math.isnan(again.score)), name
        assert len(result.scores) == len(rows) and not np.isnan(host(result.scores)).any(), name  # a number everywhere
        bounds = registry.get(name).info.score_range  # every default stays inside the range its paper states
        if bounds is not None:
            assert bounds[0] <= float(result.scores.min()) and float(result.scores.max()) <= bounds[1], (name, bounds)


PLUGINS = third_party_metrics() or ["no-plugin-installed"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", PLUGINS)
def test_every_plugin_metric_resumes_to_the_same_bits(name):
    from capeval_plugins.testing import kit

    if name not in registry.metrics():
        pytest.skip("no third-party metric is installed beside the package")
    recipe, cls = declared_recipe(name), registry.get(name).cls
    kit.check_resume(lambda **overrides: cls(**{**recipe, **overrides}), kit.sample_corpus(cls.info))
