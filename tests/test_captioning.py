"""A captioner driven and scored: ``caption_and_score`` / ``capeval caption`` caption images with a Hugging Face
image-to-text model (a tiny random BLIP of the real architecture) or a function, score the captions with the
chosen metrics in one run, save the captions beside the scores, and resume after an interruption with the
result of an uninterrupted run."""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch
from conftest import HANG_GUARD, PYTHON, capeval_in_process, random_image

import capeval_plugins
from capeval_plugins.captioning import caption_and_score, caption_folder
from capeval_plugins.inputs import InputError
from capeval_plugins.runner import Interrupted

REFS = [["a dog on the grass"], ["two cats"], ["a red car"], ["a man on a bench"], ["a bird"]]


@pytest.fixture(scope="module")
def tiny_blip(tmp_path_factory) -> str:
    from capeval_plugins.testing import build_tiny

    return str(build_tiny("blip_caption", tmp_path_factory.mktemp("blip") / "blip", seed=3))


@pytest.fixture
def photos():
    return [random_image(i, size=(40 + 4 * i, 36)) for i in range(5)]


def cider():
    return capeval_plugins.load("cider", tokenize=False)


def blip_alone(path, image, max_new_tokens=6, prompt=None):
    """The same model, one image at a time, through transformers alone: the independent reference."""
    from transformers import BlipForConditionalGeneration, BlipProcessor

    processor = BlipProcessor.from_pretrained(path)
    model = BlipForConditionalGeneration.from_pretrained(path).eval()
    inputs = processor(images=[image], text=None if prompt is None else [prompt], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.batch_decode(out, skip_special_tokens=True)[0].strip()


def test_a_tiny_blip_captions_in_batches_as_it_does_one_image_at_a_time(tiny_blip, photos):
    done = caption_and_score(photos, {"cider": cider()}, tiny_blip, REFS, batch_size=2, max_new_tokens=6)
    assert done.captions == [blip_alone(tiny_blip, image) for image in photos]
    expected = cider()(None, done.captions, REFS)
    assert done.results["cider"].scores.tolist() == pytest.approx(expected.scores.tolist(), rel=1e-12)
    assert done.batches_captioned == 3


def test_a_vision_encoder_decoder_without_a_joint_processor_captions_too(tmp_path, photos):
    from transformers import AutoTokenizer, ViTImageProcessor, VisionEncoderDecoderModel

    from capeval_plugins.testing import build_tiny

    path = str(build_tiny("vit_gpt2_caption", tmp_path / "ved", seed=1))
    done = caption_and_score(photos, ["cider"], path, REFS, batch_size=3, max_new_tokens=5)
    model = VisionEncoderDecoderModel.from_pretrained(path).eval()
    pixels = ViTImageProcessor.from_pretrained(path)(images=photos, return_tensors="pt").pixel_values
    tokenizer = AutoTokenizer.from_pretrained(path)
    expected = []
    for k in range(len(photos)):
        with torch.no_grad():
            one = model.generate(pixel_values=pixels[k:k + 1], max_new_tokens=5, do_sample=False)
        expected.append(tokenizer.batch_decode(one, skip_special_tokens=True)[0].strip())
    assert done.captions == expected
    with pytest.raises(ValueError, match="takes no prompt"):
        caption_and_score(photos, ["cider"], path, REFS, prompt="a photo of")
    photos[0].save(tmp_path / "a.png")
    (tmp_path / "refs.csv").write_text("image,references\na.png,a photo\n")
    proc = capeval_in_process(["caption", "--captioner", path, "--prompt", "a photo of", "--images", str(tmp_path),
                               "--references", str(tmp_path / "refs.csv"), "-m", "cider", "--quiet"])
    assert proc.returncode == 2 and "takes no prompt" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_prompt_is_blip_s_text_prefix_kept_as_blip_writes_it(tiny_blip, photos):
    done = caption_and_score(photos[:2], ["cider"], tiny_blip, REFS[:2], prompt="a photo of", max_new_tokens=5)
    assert done.captions == [blip_alone(tiny_blip, im, 5, "a photo of") for im in photos[:2]]
    assert all(c.startswith("a photo of") for c in done.captions)


def test_a_function_captions_decoded_rgb_images_each_distinct_image_once(photos):
    seen = []

    def predict(images):
        seen.extend(images)
        return [f"a picture {im.size[0]} wide" for im in images]

    images = [photos[0], photos[1], photos[0], photos[2]]  # one image given twice
    done = caption_and_score(images, {"cider": cider()}, predict, REFS[:4], batch_size=2)
    assert done.captions == [f"a picture {im.size[0]} wide" for im in images]
    assert len(seen) == 3 and all(im.mode == "RGB" for im in seen)
    assert done.results["cider"].scores.tolist() == pytest.approx(
        cider()(None, done.captions, REFS[:4]).scores.tolist(), rel=1e-12)


class StopAfter:
    """A stop flag that asks to stop once ``n`` captioning calls were made (as a signal would)."""

    def __init__(self, n, counter):
        self.n, self.counter = n, counter

    def __call__(self):
        return self.counter["calls"] >= self.n


@pytest.mark.parametrize("stop_after", [1, 2])
def test_an_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, photos, stop_after):
    counter = {"calls": 0}

    def predict(images):
        counter["calls"] += 1
        return [f"caption {int(np.asarray(im).sum()) % 97}" for im in images]

    whole = caption_and_score(photos, {"cider": cider()}, predict, REFS, batch_size=2)
    counter["calls"] = 0
    run_dir = f"{tmp_path / 'run'}/"  # a trailing slash: the captions' folder is still beside it
    with pytest.raises(Interrupted, match=f"after captioning {stop_after} of 3 batches"):
        caption_and_score(photos, {"cider": cider()}, predict, REFS, batch_size=2, run_dir=run_dir,
                          stop=StopAfter(stop_after, counter))
    assert counter["calls"] == stop_after
    resumed = caption_and_score(photos, {"cider": cider()}, predict, REFS, batch_size=2, run_dir=run_dir)
    assert counter["calls"] == 3  # the batches captioned before were not captioned again
    assert (resumed.batches_captioned, resumed.batches_resumed) == (3 - stop_after, stop_after)
    assert resumed.captions == whole.captions
    assert resumed.results["cider"].scores.tolist() == whole.results["cider"].scores.tolist()
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.captions").exists()  # removed when complete


def test_a_finished_captioning_is_not_redone_when_scoring_was_interrupted(tmp_path, photos):
    calls = {"n": 0}

    def predict(images):
        calls["n"] += 1
        return ["a dog"] * len(images)

    class Boom(Exception):
        pass

    class Failing(type(cider())):
        def map(self, batch):
            raise Boom("scoring failed")

    run_dir = tmp_path / "run"
    with pytest.raises(Boom):
        caption_and_score(photos, {"cider": Failing(tokenize=False)}, predict, REFS, run_dir=run_dir)
    assert calls["n"] == 1 and (tmp_path / caption_folder("run")).is_dir()
    done = caption_and_score(photos, {"cider": cider()}, predict, REFS, run_dir=run_dir)
    assert calls["n"] == 1 and done.batches_resumed == 1 and done.captions == ["a dog"] * 5


def test_a_changed_captioner_is_refused_by_the_saved_run(tmp_path, photos):
    run_dir = tmp_path / "run"

    def first(images):
        return ["a"] * len(images)

    def second(images):
        return ["b"] * len(images)

    counter = {"calls": 0}

    def counted(images):
        counter["calls"] += 1
        return first(images)

    with pytest.raises(Interrupted):
        caption_and_score(photos, ["cider"], counted, REFS, batch_size=2, run_dir=run_dir,
                          stop=StopAfter(1, counter))
    with pytest.raises(InputError, match="holds an unfinished run of something else"):
        caption_and_score(photos, ["cider"], second, REFS, batch_size=2, run_dir=run_dir)
    done = caption_and_score(photos, ["cider"], second, REFS, batch_size=2, run_dir=run_dir, restart=True)
    assert done.captions == ["b"] * 5


@pytest.mark.parametrize("answer, message", [
    (lambda ims: ["a"] * (len(ims) - 1), r"returned 1 captions for 2 images \(the batch of sample 0\)"),
    (lambda ims: [float("nan")] * len(ims), "sample 0: caption is float 'nan', not text"),
    (lambda ims: [None] * len(ims), "sample 0: caption is NoneType"),
    (lambda ims: [b"a dog"] * len(ims), "caption is bytes"),
    (lambda ims: "a dog", "returned str for 2 images"),
    (lambda ims: None, "returned NoneType"),
    (lambda ims: ["a\x00dog"] * len(ims), "caption contains a NUL character"),
])
def test_a_function_that_answers_wrongly_is_refused_in_one_line(photos, answer, message):
    with pytest.raises(InputError, match=message) as err:
        caption_and_score(photos[:2], ["cider"], answer, REFS[:2])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("images", [[], None, "a.png", (p for p in ["a.png"]), {"a.png"}])
def test_images_that_are_no_sequence_are_refused_in_one_line(images):
    with pytest.raises(InputError, match="give a non-empty sequence of images"):
        caption_and_score(images, ["cider"], lambda ims: ["a"] * len(ims), None)


def test_metrics_by_name_or_label_and_a_non_metric_refused(photos):
    done = caption_and_score(photos[:2], {"mine": "cider"}, lambda ims: ["a dog"] * len(ims), REFS[:2])
    assert list(done.results) == ["mine"]
    with pytest.raises(InputError, match="builtin_function_or_method is not a metric"):
        caption_and_score(photos[:2], {"x": len}, lambda ims: ["a"] * len(ims), REFS[:2])


def test_missing_references_are_refused_before_any_caption(photos):
    calls = []
    with pytest.raises(InputError, match="cider needs references"):
        caption_and_score(photos[:2], ["cider"], lambda ims: calls.append(1), None)
    assert not calls


def test_a_bad_image_is_refused_before_any_caption(tmp_path, photos):
    calls = []
    with pytest.raises(InputError, match="sample 1: .*not-there.png"):
        caption_and_score([photos[0], str(tmp_path / "not-there.png")], ["cider"], lambda ims: calls.append(1),
                          REFS[:2])
    assert not calls


def test_capeval_caption_with_a_function_saves_captions_beside_scores(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for k in range(3):
        random_image(k).save(folder / f"im{k}.png")
    (tmp_path / "refs.jsonl").write_text("".join(
        json.dumps({"id": f"q{k}", "image": f"im{k}.png", "references": REFS[k]}) + "\n" for k in range(3)))
    (tmp_path / "mycap.py").write_text("def predict(images):\n    return [f'a photo {i.size[0]}' for i in images]\n")
    out = tmp_path / "scores.jsonl"
    proc = capeval_in_process(["caption", "--predict", f"{tmp_path / 'mycap.py'}:predict", "--images", str(folder),
                               "--references", str(tmp_path / "refs.jsonl"), "-m", "cider", "-o", "tokenize=false",
                               "--out", str(out), "--quiet"])
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["image"], r["caption"]) for r in rows] == [(f"q{k}", f"im{k}.png", "a photo 48")
                                                                   for k in range(3)]
    expected = cider()(None, ["a photo 48"] * 3, REFS[:3]).scores.tolist()
    assert [r["cider"] for r in rows] == pytest.approx(expected, rel=1e-12)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["batches_captioned"] == 1


def test_capeval_caption_with_a_tiny_blip_and_every_image_of_a_folder(tmp_path, tiny_blip, tiny_clip):
    folder = tmp_path / "imgs"
    folder.mkdir()
    photos = [random_image(k, size=(40 + 4 * k, 36)) for k in range(3)]
    for k, im in enumerate(photos):
        im.save(folder / f"{k}.png")
    out = tmp_path / "scores.csv"
    proc = capeval_in_process(["caption", "--captioner", tiny_blip, "--max-new-tokens", "6", "--images", str(folder),
                               "-m", "clipscore", "--model", tiny_clip, "--out", str(out), "--quiet"])
    assert proc.returncode == 0, proc.stderr
    import csv

    rows = list(csv.DictReader(out.open()))
    captions = [blip_alone(tiny_blip, im) for im in photos]
    assert [r["caption"] for r in rows] == captions and [r["image"] for r in rows] == ["0.png", "1.png", "2.png"]
    files = [str(folder / f"{k}.png") for k in range(3)]
    expected = capeval_plugins.load("clipscore", model=tiny_clip)(files, captions)
    assert [float(r["clipscore"]) for r in rows] == pytest.approx(expected.scores.tolist(), abs=1e-5)


def test_a_captioner_not_cached_while_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    random_image(0).save(tmp_path / "a.png")
    (tmp_path / "refs.csv").write_text("image,references\na.png,a photo\n")
    proc = capeval_in_process(["caption", "--captioner", "nobody/no-such-captioner", "--images", str(tmp_path),
                               "--references", str(tmp_path / "refs.csv"), "-m", "cider", "-o", "tokenize=false",
                               "--quiet"])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "nobody/no-such-captioner" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--predict", "nomodule_xyz:fn"], "cannot import nomodule_xyz"),
    (["--predict", "json:no_such_fn"], "json has no function 'no_such_fn'"),
    (["--predict", "justaname"], "expects MODULE:FUNCTION"),
])
def test_capeval_caption_refuses_a_bad_predict_in_one_line(tmp_path, args, message):
    random_image(0).save(tmp_path / "a.png")
    proc = capeval_in_process(["caption", *args, "--images", str(tmp_path), "-m", "cider", "--quiet"])
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_capeval_caption_resumes_after_a_real_sigint(tmp_path):
    """A SIGINT while captioning stops after the batch at work (exit 130); the same command resumes and writes
    what an uninterrupted run writes."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    for k in range(5):
        random_image(k, size=(40 + k, 36)).save(folder / f"{k}.png")
    (tmp_path / "refs.csv").write_text("image,references\n" + "".join(f"{k}.png,a photo\n" for k in range(5)))
    (tmp_path / "cap.py").write_text(
        "import os, signal\n"
        "calls = 0\n"
        "def predict(images):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 2 and os.path.exists(os.environ['STOP_FLAG']):\n"
        "        os.remove(os.environ['STOP_FLAG'])\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return [f'a photo {i.size[0]} wide' for i in images]\n")
    flag = tmp_path / "stop"

    def capeval(out):
        cmd = [PYTHON, "-m", "capeval_plugins.cli", "caption", "--predict",
               f"{tmp_path / 'cap.py'}:predict", "--images", str(folder), "--references", str(tmp_path / "refs.csv"),
               "-m", "cider", "-o", "tokenize=false", "--caption-batch-size", "2", "--out", str(out), "--quiet"]
        return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "STOP_FLAG": str(flag)},
                              timeout=HANG_GUARD)

    whole = capeval(tmp_path / "whole.jsonl")
    assert whole.returncode == 0, whole.stderr
    flag.write_text("")
    first = capeval(tmp_path / "scores.jsonl")
    assert first.returncode == 130 and "after captioning 2 of 3 batches" in first.stderr, first.stderr
    assert (tmp_path / "scores.jsonl.capeval-run.captions").is_dir()
    second = capeval(tmp_path / "scores.jsonl")
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert (summary["batches_captioned"], summary["batches_caption_resumed"]) == (1, 2)
    assert (tmp_path / "scores.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    assert not (tmp_path / "scores.jsonl.capeval-run.captions").exists()


@pytest.mark.parametrize("where", ["image", "run_dir", "captions_dir"])
def test_capeval_caption_never_writes_over_an_image_or_into_a_run_folder(tmp_path, where):
    random_image(0).save(tmp_path / "a.png")
    (tmp_path / "refs.csv").write_text("image,references\na.png,a photo\n")
    (tmp_path / "cap.py").write_text("def predict(images):\n    return ['a'] * len(images)\n")
    run_dir = ["--run-dir", str(tmp_path / "run")]
    out, extra = {"image": (tmp_path / "a.png", []), "run_dir": (tmp_path / "run", run_dir),
                  "captions_dir": (tmp_path / "run.captions" / "x.jsonl", run_dir)}[where]
    before = (tmp_path / "a.png").read_bytes()
    proc = capeval_in_process(["caption", "--predict", f"{tmp_path / 'cap.py'}:predict", "--images", str(tmp_path),
                               "--references", str(tmp_path / "refs.csv"), "-m", "cider", "--out", str(out), *extra])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (tmp_path / "a.png").read_bytes() == before


def test_capeval_caption_under_several_ranks_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    proc = capeval_in_process(["caption", "--predict", "json:dumps", "--images", str(tmp_path), "-m", "cider"])
    assert proc.returncode == 2 and "runs in one process" in proc.stderr


def test_a_file_name_that_is_not_utf8_is_refused_before_any_work(tmp_path):
    """The image column is text: a folder holding ``b_\\xff.png`` was captioned and scored whole, then the CSV or
    Parquet table could not be written (a traceback, every result lost), and JSON Lines held a lone surrogate."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    random_image(0).save(folder / "a.png")
    random_image(1).save(os.fsdecode(bytes(folder) + b"/b_\xff.png"))
    calls = tmp_path / "calls"
    (tmp_path / "mycap.py").write_text(f"def predict(images):\n    open({str(calls)!r}, 'a').write('x')\n"
                                       "    return ['a photo'] * len(images)\n")
    for out in ("scores.csv", "scores.jsonl"):
        proc = capeval_in_process(["caption", "--predict", f"{tmp_path / 'mycap.py'}:predict", "--images", str(folder),
                                   "-m", "bleu4", "-o", "tokenize=false", "--out", str(tmp_path / out), "--quiet"])
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "not UTF-8" in proc.stderr and r"b_\xff.png" in proc.stderr
        assert not calls.exists() and not (tmp_path / out).exists()


@pytest.mark.parametrize("where", ["absolute", "relative"])
def test_a_captioner_folder_that_does_not_exist_is_named_as_such(tmp_path, monkeypatch, where):
    """The hub client took a missing folder for a malformed repo id ("Repo id must be in the form ...")."""
    from capeval_plugins.models.captioner import HFCaptioner
    from capeval_plugins.resources.wholeness import ModelLoadError

    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "nomodel") if where == "absolute" else "./nomodel"
    with pytest.raises(ModelLoadError, match=f"no such file or folder: {missing}"):
        HFCaptioner(missing).load()
