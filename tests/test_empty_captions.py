"""An empty or blank caption is an answer to score, for every registered metric (DESIGN.md: "an empty generation is
an answer and gets the reference implementation's score"): each metric, built on tiny models, scores a corpus in
which some captions are "", "   " or "\\t" and gives every sample a finite number in the metric's range, and
skips none. The package's metrics run on the tiny recipes below; a metric of a plugin installed beside the package
runs on the recipe it declares (``Metric.tiny_recipe``) and is skipped, saying so, when it declares none. The
reference implementations' own numbers for "" are checked where they run here:
the classic metrics against pycocoevalcap (tests/test_pycocoevalcap_adapter.py), BERTScore against bert_score
(tests/test_bertscore.py)."""
from __future__ import annotations

import json
import math
from typing import Callable

import numpy as np
import pytest
from conftest import declared_recipe, has_java, random_image
from test_lvlm import scripted_llava, sharp_llava
from test_resume_every_metric import EXPERT_JUDGE, rigel_checkpoint

from capeval_plugins import registry, runner
from capeval_plugins.core.arrays import host
from capeval_plugins.testing.corpus import caption_corpus

N_IMAGES = 21  # MID's fit on the tiny CLIP needs more than 32 (image, reference) pairs
BLANK = {3: "", 10: "   ", 17: "\t", 30: ""}
# The classic metrics run on pycocoevalcap's PTB tokenizer (Java); SPICE also needs CoreNLP jars fetched online.
NEEDS_JAVA = {"bleu1", "bleu2", "bleu3", "bleu4", "meteor", "rouge_l", "cider", "spice"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Two captions per image (four of them empty or blank), two references each, and the images drawn in
    advance for every text (DINO-Cycle's and Redemption Score's stand-in for Stable Diffusion 3)."""
    root = tmp_path_factory.mktemp("empty")
    lines = caption_corpus(4 * N_IMAGES, seed=5)
    images = [random_image(700 + i, size=(40 + i % 5, 36)) for i in range(N_IMAGES)]
    captions = [BLANK.get(k, lines[k]) for k in range(2 * N_IMAGES)]
    references = [[lines[2 * N_IMAGES + k // 2], lines[3 * N_IMAGES + k // 2]] for k in range(2 * N_IMAGES)]
    drawn = root / "generated"
    drawn.mkdir()
    texts = list(dict.fromkeys(captions + [r for refs in references for r in refs]))
    for i in range(len(texts)):
        random_image(900 + i, size=(28, 28)).save(drawn / f"{i}.png")
    (drawn / "index.jsonl").write_text("".join(json.dumps({"caption": t, "image": f"{i}.png"}) + "\n"
                                               for i, t in enumerate(texts)))
    return {"images": [images[k // 2] for k in range(2 * N_IMAGES)], "captions": captions, "references": references,
            "drawn": str(drawn)}


@pytest.fixture(scope="module")
def recipes(tiny_root, corpus) -> dict[str, Callable[[], dict]]:
    """Options that build each of the package's metrics on tiny models (built when a test asks for them)."""
    from capeval_plugins.testing import tiny_checkpoint

    model = lambda kind: str(tiny_checkpoint(kind, root=tiny_root))  # noqa: E731
    judge = lambda: scripted_llava(("▁[/INST]", "▁", "0", ".", "8", "A", "▁dog"))  # noqa: E731
    return {
        "clipscore": lambda: {"model": model("clip")}, "refclipscore": lambda: {"model": model("clip")},
        "mid": lambda: {"model": model("clip")}, "msd_score": lambda: {"model": model("clip")},
        "soft_msd": lambda: {"model": model("clip")}, "bertscore": lambda: {"model": model("roberta")},
        "pacscore": lambda: {"model": model("pacs")}, "refpacscore": lambda: {"model": model("pacs")},
        "pacscore_pp": lambda: {"model": model("pacs_pp")}, "refpacscore_pp": lambda: {"model": model("pacs_pp")},
        "polos": lambda: {"model": model("polos")}, "vela": lambda: {"model": model("vela")},
        **{name: dict for name in NEEDS_JAVA},
        "fleur": lambda: {"model": judge()}, "discode": lambda: {"model": judge()},
        "expert": lambda: {"model": scripted_llava(EXPERT_JUDGE), "max_new_tokens": 8},
        "rigel": lambda: {"checkpoint": rigel_checkpoint(sharp_llava())},
        "vilbertscore": lambda: {"model": model("vilt")},
        "dino_cycle": lambda: {"model": model("dino"), "generated_images": corpus["drawn"]},
        "redemption_score": lambda: {"clip_model": model("clip"), "dino_model": model("dino"),
                                     "generated_images": corpus["drawn"], "bertscore_model": model("deberta_v3"),
                                     "bertscore_num_layers": 2},
    }


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(registry.metrics()))
def test_every_metric_scores_an_empty_caption(name, recipes, corpus):
    if registry.get(name).plugin != registry.BUILTIN:  # an installed plugin's metric: on the recipe it declares
        options = declared_recipe(name)
    elif name not in recipes:
        pytest.fail(f"{name} has no tiny recipe here: add one, so that its empty-caption score is checked")
    else:
        options = recipes[name]()
    if name in NEEDS_JAVA and not has_java():
        pytest.skip("Java is needed for PTB tokenisation")
    if name == "spice":
        from capeval_plugins.adapters.pycocoevalcap import spice_available

        if not spice_available():
            pytest.skip("SPICE's CoreNLP jars are fetched online on first use")
    metric = registry.load(name, **options)
    result = runner.score(metric, corpus["images"], corpus["captions"], corpus["references"])
    assert not result.skipped and result.corpus_extras.get("n_skipped", 0) == 0
    assert np.isfinite(host(result.scores)).all(), (name, result.scores[list(BLANK)])
    assert math.isfinite(result.score)
    bounds = registry.get(name).info.score_range
    if bounds is not None:
        assert bounds[0] <= result.scores.min() and result.scores.max() <= bounds[1]
    if metric.info.references != "never" and name in NEEDS_JAVA:  # stock pycocoevalcap scores them 0
        assert np.abs(host(result.scores)[list(BLANK)]).max() == 0
