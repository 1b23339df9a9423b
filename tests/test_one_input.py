"""One input, one score: every entry point hands a metric's processor the image the user gave, pixel for pixel,
so one photo and caption give the reference computation's number (the model's own processor on the full
image, then the model) through ``load``, the command line, evaluate, torchmetrics, pycocoevalcap and lm-eval
(lmms-eval: tests/test_lmms_eval_adapter.py), on photos far above the processor's side and of odd aspect
ratios; and a score does not depend on the other metrics of the run."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LARGE_PHOTO_CAPTIONS, PYTHON, large_photos, reference_clip_cosines, run
from PIL import Image

import capeval_plugins
from capeval_plugins import runner

pytest.importorskip("skimage")
pytest.importorskip("matplotlib")

CAPEVAL = str(Path(PYTHON).parent / "capeval")
# Cosines of float32 features: what float32 rounding and a different batching may move them by.
TOL = 1e-6


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[str]:
    return [str(p) for p in large_photos(tmp_path_factory.mktemp("photos"))]


@pytest.fixture(scope="module")
def reference(tiny_clip, photos) -> np.ndarray:
    return reference_clip_cosines(tiny_clip, photos, LARGE_PHOTO_CAPTIONS)


def clip_s(cosines) -> np.ndarray:
    return 2.5 * np.clip(np.asarray(cosines, dtype=np.float64), 0, None)


def test_load_scores_paths_pil_images_arrays_and_tensors_as_given(tiny_clip, photos, reference):
    metric = capeval_plugins.load("clipscore", model=tiny_clip)
    pil = [Image.open(p).convert("RGB") for p in photos]
    forms = {"paths": photos, "pil": pil, "arrays": [np.asarray(img) for img in pil],
             "tensors": [torch.from_numpy(np.array(img)).permute(2, 0, 1) for img in pil]}
    for form, images in forms.items():
        result = metric(images, LARGE_PHOTO_CAPTIONS)
        assert result.extras["cosine"].numpy() == pytest.approx(reference, abs=TOL), form
        assert result.scores.numpy() == pytest.approx(clip_s(reference), abs=2.5 * TOL), form


def test_one_photo_one_score_through_every_entry_point(tiny_clip, photos, reference, tmp_path):
    import evaluate

    from capeval_plugins.adapters.lm_eval import CaptionItem, aggregate
    from capeval_plugins.pycocoevalcap import ClipScore, ImageResolver
    from capeval_plugins.torchmetrics import CLIPScore

    captions = LARGE_PHOTO_CAPTIONS
    expected = clip_s(reference)
    got: dict[str, np.ndarray] = {}

    for k, (photo, caption) in enumerate(zip(photos, captions)):  # one photo, one caption, one call
        one = capeval_plugins.load("clipscore", model=tiny_clip)([photo], [caption])
        assert float(one.extras["cosine"][0]) == pytest.approx(reference[k], abs=TOL), photo

    got["evaluate"] = np.asarray(evaluate.load("clipscore", model=tiny_clip).compute(
        images=photos, predictions=captions)["cosine"])

    tm = CLIPScore(model=tiny_clip)
    tm.update(photos[:2], captions[:2])
    tm.update(photos[2:], captions[2:])
    got["torchmetrics"] = tm.compute_all().extras["cosine"].numpy()

    scorer = ClipScore(ImageResolver("/", mapping=dict(enumerate(photos))), model=tiny_clip)
    # lower-case, unpunctuated captions look PTB-tokenised: handed over as COCO holds them (captions as written)
    scorer.compute_score({i: [{"caption": "a reference"}] for i in range(len(photos))},
                         {i: [{"caption": c}] for i, c in enumerate(captions)})
    got["pycocoevalcap"] = scorer.last_result.extras["cosine"].numpy()

    caption_file = tmp_path / "captions.jsonl"
    caption_file.write_text("".join(json.dumps({"image": p, "caption": c}) + "\n" for p, c in zip(photos, captions)))
    out = tmp_path / "scores.jsonl"
    run([CAPEVAL, "score", "-m", "clipscore", "--model", tiny_clip, "--captions", str(caption_file), "--out", str(out),
         "--quiet"])
    got["cli"] = np.asarray([json.loads(line)["clipscore.cosine"] for line in out.read_text().splitlines()])

    for entry, cosines in got.items():
        assert cosines == pytest.approx(reference, abs=TOL), entry

    # lm-eval reports a task's corpus score (the mean of the per-sample scores)
    items = [CaptionItem(p, c, None) for p, c in zip(photos, captions)]
    assert aggregate("clipscore", items, model=tiny_clip) == pytest.approx(expected.mean(), abs=2.5 * TOL)


@pytest.mark.filterwarnings("ignore:fleur")  # a tiny random LLaVA writes no number: NaN, said in a warning
def test_a_score_does_not_depend_on_the_other_metrics_of_the_run(tiny_clip, photos, tiny_root):
    """A metric that takes full-size images beside CLIPScore changes nothing of CLIPScore's numbers."""
    from capeval_plugins.testing import tiny_checkpoint

    llava = str(tiny_checkpoint("llava", root=tiny_root))
    clip = capeval_plugins.load("clipscore", model=tiny_clip)
    alone = runner.score_many({"clipscore": clip}, photos, LARGE_PHOTO_CAPTIONS)["clipscore"]
    fleur = capeval_plugins.load("fleur", model=llava)
    together = runner.score_many({"clipscore": clip, "fleur": fleur}, photos, LARGE_PHOTO_CAPTIONS)
    assert torch.equal(together["clipscore"].extras["cosine"], alone.extras["cosine"])


def test_evaluate_stores_in_memory_images_without_changing_a_pixel(tiny_clip, photos):
    """Arrow keeps what evaluate is given until compute(): a PIL image decoded from JPEG bytes must not be
    re-encoded as a JPEG, nor an opened image changed in memory be read again from its file."""
    import io

    import evaluate

    with open(photos[2], "rb") as f:
        from_bytes = Image.open(io.BytesIO(f.read()))  # format JPEG, no file name
    edited = Image.open(photos[3])  # a file name; its pixels changed in memory
    edited.load()
    edited.paste((255, 0, 0), (0, 0, 200, 200))
    images, captions = [from_bytes, edited], LARGE_PHOTO_CAPTIONS[2:4]
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, captions).extras["cosine"].numpy()
    assert direct == pytest.approx(reference_clip_cosines(tiny_clip, [from_bytes.convert("RGB"), edited.convert("RGB")],
                                                          captions), abs=TOL)
    got = evaluate.load("clipscore", model=tiny_clip).compute(images=images, predictions=captions)["cosine"]
    assert np.asarray(got) == pytest.approx(direct, abs=TOL)


def test_task_helpers_show_the_captioning_model_the_image_the_metrics_score(tmp_path):
    """lm-eval's and lmms-eval's doc_to_image convert as every metric does: a 16-bit image is scaled by 65535,
    where ``convert("RGB")`` would clip it to white."""
    from capeval_plugins.inputs import image_source
    from capeval_plugins.lm_eval_tasks.utils import doc_to_image as lm_eval_image
    from capeval_plugins.lmms_eval_tasks.utils import doc_to_image as lmms_eval_image

    path = tmp_path / "deep.png"
    Image.fromarray(np.linspace(0, 65535, 64 * 48).astype(np.uint16).reshape(48, 64)).save(path)
    with Image.open(path) as img:
        assert img.mode.startswith("I;16")
        via_lmms = np.asarray(lmms_eval_image({"image": img})[0])
    via_lm_eval = np.asarray(lm_eval_image({"image_path": str(path)})[0])
    scored = np.asarray(image_source(str(path), 0).load())
    assert via_lmms.shape == (48, 64, 3) and 0 < via_lmms.mean() < 255
    assert np.array_equal(via_lmms, scored) and np.array_equal(via_lm_eval, scored)
