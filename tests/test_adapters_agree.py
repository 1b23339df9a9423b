"""The same inputs give the same per-sample scores through every ecosystem."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import EXAMPLES, PYTHON, run

import capeval_plugins
from capeval_plugins.caption_files import read_captions


@pytest.mark.slow
def test_direct_evaluate_torchmetrics_pycocoevalcap_lm_eval_and_cli_agree(tiny_clip, tmp_path):
    import evaluate

    from capeval_plugins.pycocoevalcap import ClipScore, ImageResolver
    from capeval_plugins.torchmetrics import CLIPScore

    records = read_captions(EXAMPLES / "captions.jsonl", EXAMPLES / "images")
    images, captions, refs = records.images, records.captions, records.references
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, captions, refs)
    expected = direct.scores.tolist()

    via_evaluate = evaluate.load("clipscore", model=tiny_clip).compute(images=images, predictions=captions, references=refs)
    assert via_evaluate["scores"] == pytest.approx(expected, abs=1e-6)

    tm = CLIPScore(model=tiny_clip)
    tm.update(images[:3], captions[:3], refs[:3])
    tm.update(images[3:], captions[3:], refs[3:])
    assert tm.compute_all().scores.tolist() == pytest.approx(expected, abs=1e-6)

    resolver = ImageResolver("/", mapping={i: p for i, p in enumerate(images)})
    _, coco_scores = ClipScore(resolver, model=tiny_clip).compute_score(
        {i: refs[i] for i in range(len(images))}, {i: [c] for i, c in enumerate(captions)})
    assert list(coco_scores) == pytest.approx(expected, abs=1e-6)

    out = tmp_path / "cli.jsonl"
    run([str(Path(PYTHON).parent / "capeval"), "score", "--metric", "clipscore", "--model", tiny_clip,
         "--captions", str(EXAMPLES / "captions.jsonl"), "--images", str(EXAMPLES / "images"), "--out", str(out),
         "--quiet"])
    assert [json.loads(x)["clipscore"] for x in out.read_text().splitlines()] == pytest.approx(expected, abs=1e-6)

    # lm-eval reports the corpus score of the task (per-document values are items, not numbers)
    from capeval_plugins.adapters.lm_eval import CaptionItem, aggregate

    items = [CaptionItem(i, c, r) for i, c, r in zip(images, captions, refs)]
    assert aggregate("clipscore", items, model=tiny_clip) == pytest.approx(direct.score, abs=1e-6)
