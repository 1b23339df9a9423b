"""lm-eval: metrics registered beside the built-ins; the shipped caption task scores a captioner."""
from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path

import pytest
from conftest import EXAMPLES, HANG_GUARD, PYTHON, run

import capeval_plugins
from capeval_plugins.caption_files import read_captions

lm_eval = pytest.importorskip("lm_eval")



def tasks_only(include, **kwargs):
    """A TaskManager of the given task folders alone: indexing lm-eval's 14,000 built-in tasks too takes 6 s."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=False, **kwargs)

def test_registration_keeps_builtins_and_is_idempotent():
    """In a fresh interpreter, importing ours first must not make lm-eval's lazily loaded built-ins vanish."""
    proc = run([PYTHON, "-c", (
        "import capeval_plugins.lm_eval as ours\n"
        "import lm_eval.api.registry as reg\n"
        "names = ours.register(); ours.register()\n"
        "print(sorted({'exact_match', 'bleu', 'acc', 'perplexity'} - set(reg.metric_registry)))\n"
        "print(sorted({'clipscore', 'capeval/clipscore', 'refclipscore'} - set(names)))\n"
        "print(reg.get_aggregation('capeval/clipscore') is not None, reg.get_aggregation('mean') is not None)\n"
    )])
    missing_builtins, missing_ours, aggregations = proc.stdout.strip().splitlines()[-3:]
    assert missing_builtins == "[]" and missing_ours == "[]" and aggregations == "True True"


def _answering(answer):
    """An lm-eval model that answers each request with ``answer(doc)``: what lm-eval's models return, one
    generation per request ("" when the model said nothing)."""
    from lm_eval.api.model import LM

    class Answering(LM):
        MULTIMODAL = True

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            return [answer(r.doc) for r in requests]

    return Answering()


def _captioner():
    records = read_captions(EXAMPLES / "captions.jsonl", EXAMPLES / "images")
    return _answering(lambda doc: records.captions[doc["id"]]), records


@pytest.mark.slow
def test_caption_task_scores_the_generations(tiny_clip):

    from capeval_plugins.adapters.lm_eval import tasks_dir

    model, records = _captioner()
    metadata = {"captions": str(EXAMPLES / "captions.jsonl"), "images": str(EXAMPLES / "images"),
                "metrics": {"clipscore": {"model": tiny_clip}, "capeval/refclipscore": {"model": tiny_clip}}}
    out = lm_eval.simple_evaluate(model=model, tasks=["capeval_caption"],
                                  task_manager=tasks_only(str(tasks_dir()), metadata=metadata))
    got = out["results"]["capeval_caption"]
    direct = capeval_plugins.load("refclipscore", model=tiny_clip)(records.images, records.captions, records.references)
    assert got["clipscore,none"] == pytest.approx(direct.corpus_extras["mean_clipscore"], abs=1e-6)
    assert got["capeval/refclipscore,none"] == pytest.approx(direct.score, abs=1e-6)


@pytest.mark.slow
def test_task_yaml_can_be_included_with_other_options(tiny_clip, tmp_path):
    """The lm-eval way to change metrics: a YAML that includes the shipped one."""

    from capeval_plugins.adapters.lm_eval import tasks_dir

    (tmp_path / "mine.yaml").write_text(
        f"include: {tasks_dir() / 'capeval_caption.yaml'}\n"
        "task: my_caption\n"
        "metric_list:\n"
        f"  - metric: clipscore\n    model: {tiny_clip}\n    w: 1.0\n"
        "    aggregation: capeval/clipscore\n    higher_is_better: true\n")
    model, records = _captioner()
    tm = tasks_only([str(tasks_dir()), str(tmp_path)],
                     metadata={"captions": str(EXAMPLES / "captions.jsonl"), "images": str(EXAMPLES / "images")})
    out = lm_eval.simple_evaluate(model=model, tasks=["my_caption"], task_manager=tm)
    direct = capeval_plugins.load("clipscore", model=tiny_clip, w=1.0)(records.images, records.captions)
    assert out["results"]["my_caption"]["clipscore,none"] == pytest.approx(direct.score, abs=1e-6)


@pytest.mark.slow
def test_capeval_lm_eval_lists_the_shipped_task():
    from pathlib import Path

    proc = run([str(Path(PYTHON).parent / "capeval-lm-eval"), "ls", "tasks"], timeout=HANG_GUARD)
    assert "capeval_caption" in proc.stdout


def test_an_unscorable_document_is_counted_in_the_results_and_an_empty_generation_is_scored():
    """An empty generation is the model's answer (CIDEr 0, as pycocoevalcap); a document no metric can take
    (a NUL in the generation) is left out, warned about and counted by ``<name>_n_skipped``."""
    import warnings

    from capeval_plugins.adapters.lm_eval import CaptionItem, SkipCount, aggregate
    from capeval_plugins.inputs import InputError

    refs = [["a dog runs on grass"], ["a cat sits"], ["a red car"], ["two birds fly"]]
    captions = ["a dog runs", "", "a red\x00car", "birds flying"]
    items = [CaptionItem(None, c, r) for c, r in zip(captions, refs)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = aggregate("cider", items, tokenize=False)
    said = [str(w.message) for w in caught if "documents not scored" in str(w.message)]
    assert len(said) == 1 and "1 of 4 documents not scored (document 2: caption contains a NUL" in said[0]
    assert aggregate("cider", [SkipCount(it) for it in items], tokenize=False) == 1.0
    kept = [0, 1, 3]
    expected = capeval_plugins.load("cider", tokenize=False)(None, [captions[i] for i in kept], [refs[i] for i in kept])
    assert got == pytest.approx(expected.score, rel=1e-12) and expected.scores[1] == 0
    with pytest.raises(InputError, match="sample 2: caption contains a NUL"):
        aggregate("cider", items, tokenize=False, on_error="raise")


# --- a replay of real captions, two of them empty, against pycocoevalcap -----------------------------------------

def _replay(tmp_path):
    """Twelve real captions of examples/photos.jsonl, two of them empty (a model that said nothing), with their
    photos written beside them; returns (caption file, images folder, rows)."""
    pytest.importorskip("skimage")
    import json

    from capeval_plugins.testing.realistic import write_photos

    write_photos(tmp_path / "photos")
    rows = [json.loads(line) for line in (EXAMPLES / "photos.jsonl").read_text().splitlines()][:12]
    for k in (3, 8):
        rows[k]["caption"] = ""
    path = tmp_path / "replay.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, tmp_path / "photos", rows


def _replayer(rows):
    return _answering(lambda doc: rows[doc["id"]]["caption"])


def _pycocoevalcap(rows):
    """The same captions through the usual pycocoevalcap loop (PTB tokenisation, then Cider and Bleu)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    gts = {i: [{"caption": c} for c in r["references"]] for i, r in enumerate(rows)}
    res = {i: [{"caption": r["caption"]}] for i, r in enumerate(rows)}
    tokenizer = PTBTokenizer()
    gts, res = tokenizer.tokenize(gts), tokenizer.tokenize(res)
    return Cider().compute_score(gts, res)[0], Bleu(4).compute_score(gts, res)[0][3]


@pytest.mark.slow
def test_empty_generations_give_pycocoevalcaps_number_through_lm_eval(tmp_path):
    from conftest import has_java

    from capeval_plugins.adapters.lm_eval import tasks_dir

    if not has_java():
        pytest.skip("PTB tokenisation needs Java")
    path, photos, rows = _replay(tmp_path)
    metadata = {"captions": str(path), "images": str(photos), "metrics": {"cider": {}, "bleu4": {}}}
    out = lm_eval.simple_evaluate(model=_replayer(rows), tasks=["capeval_caption"],
                                  task_manager=tasks_only(str(tasks_dir()), metadata=metadata))
    got = out["results"]["capeval_caption"]
    cider, bleu4 = _pycocoevalcap(rows)
    assert got["cider,none"] == pytest.approx(cider, rel=1e-12) and got["bleu4,none"] == pytest.approx(bleu4, rel=1e-12)
    assert got["cider_n_skipped,none"] == 0 and got["bleu4_n_skipped,none"] == 0


@pytest.mark.slow
def test_a_task_mixing_capeval_metrics_with_options_and_lm_evals_bleu(tmp_path, tiny_clip):
    """Two habits of lm-eval users: the shipped caption task included with a capeval metric that takes options
    beside lm-eval's own ``bleu``, and a plain lm-eval task (no class of ours) scoring capeval's text metric with
    its options beside ``bleu``: each gives lm-eval's bleu and capeval's numbers as if computed alone."""
    import json

    import sacrebleu

    from capeval_plugins.adapters.lm_eval import tasks_dir

    path, photos, rows = _replay(tmp_path)
    rows = rows[:6]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mixed.yaml").write_text(
        f"include: {tasks_dir() / 'capeval_caption.yaml'}\n"
        "task: mixed_caption\n"
        "metric_list:\n"
        f"  - metric: clipscore\n    model: {tiny_clip}\n    w: 2.0\n"
        "    aggregation: capeval/clipscore\n    higher_is_better: true\n"
        "  - metric: bleu\n    aggregation: bleu\n    higher_is_better: true\n")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "reference": r["references"][0]}) + "\n" for i, r in enumerate(rows)))
    (tmp_path / "tasks" / "plain.yaml").write_text(
        "task: plain_caption\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        "doc_to_text: 'Describe the image.'\n"
        "doc_to_target: reference\n"
        "generation_kwargs:\n  until: ['\\n']\n"
        "metric_list:\n"
        "  - metric: cider\n    aggregation: capeval/cider\n    higher_is_better: true\n    tokenize: false\n"
        "    sigma: 3.0\n"
        "  - metric: bleu\n    aggregation: bleu\n    higher_is_better: true\n")
    tm = tasks_only([str(tasks_dir()), str(tmp_path / "tasks")],
                     metadata={"captions": str(path), "images": str(photos)})
    out = lm_eval.simple_evaluate(model=_replayer(rows), tasks=["mixed_caption", "plain_caption"], task_manager=tm)
    mixed, plain = out["results"]["mixed_caption"], out["results"]["plain_caption"]
    captions = [r["caption"] for r in rows]
    clip = capeval_plugins.load("clipscore", model=tiny_clip, w=2.0)([str(photos / r["image"]) for r in rows], captions)
    assert mixed["clipscore,none"] == pytest.approx(clip.score, abs=1e-6) and mixed["clipscore_n_skipped,none"] == 0
    firsts = [r["references"][0] for r in rows]
    bleu = sacrebleu.corpus_bleu(captions, [firsts]).score
    assert mixed["bleu,none"] == pytest.approx(bleu) and plain["bleu,none"] == pytest.approx(bleu)
    cider = capeval_plugins.load("cider", tokenize=False, sigma=3.0)(None, captions, [[f] for f in firsts])
    assert plain["cider,none"] == pytest.approx(cider.score, rel=1e-12) and plain["cider_n_skipped,none"] == 0


@pytest.mark.slow
def test_caption_task_reads_one_reference_string_as_one_reference_and_falls_back_to_doc_to_target(tmp_path):
    """A generic task with ``class: CaptionTask``: a "references" field holding one string is one reference (it
    was split into characters: CIDEr 0.003 for 1.19), and documents without that field give their references
    through the task's doc_to_target (they gave none)."""
    import json

    path, photos, rows = _replay(tmp_path)
    rows = rows[:6]
    captions = [r["caption"] for r in rows]
    (tmp_path / "tasks").mkdir()
    layouts = {"one_string": ({"references": r["references"][0]} for r in rows), "other_field": (
        {"refs": r["references"]} for r in rows)}
    for name, docs in layouts.items():
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"id": i, **d}) + "\n" for i, d in enumerate(docs)))
        (tmp_path / "tasks" / f"{name}.yaml").write_text(
            f"task: {name}\n"
            "class: !function capeval_plugins.adapters.lm_eval.CaptionTask\n"
            f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
            "output_type: generate_until\ndoc_to_text: 'Describe the image.'\n"
            f"doc_to_target: {'references' if name == 'one_string' else 'refs'}\n"
            "generation_kwargs:\n  until: ['\\n']\n"
            "metric_list:\n  - metric: cider\n    aggregation: capeval/cider\n    higher_is_better: true\n"
            "    tokenize: false\n")
    out = lm_eval.simple_evaluate(model=_replayer(rows), tasks=list(layouts),
                                  task_manager=tasks_only(str(tmp_path / "tasks")))
    cider = capeval_plugins.load("cider", tokenize=False)
    firsts = cider(None, captions, [[r["references"][0]] for r in rows]).score
    every = cider(None, captions, [r["references"] for r in rows]).score
    assert out["results"]["one_string"]["cider,none"] == pytest.approx(firsts, rel=1e-12)
    assert out["results"]["other_field"]["cider,none"] == pytest.approx(every, rel=1e-12)
    assert out["results"]["other_field"]["cider_n_skipped,none"] == 0


def test_a_task_that_cannot_score_a_capeval_metric_is_refused_before_generation(tmp_path, tiny_clip):
    import json

    from lm_eval.tasks import TaskManager

    from capeval_plugins.adapters.lm_eval import check_tasks
    from capeval_plugins.inputs import InputError

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"refs": ["a dog", "a brown dog"], "ref": "a dog"}) + "\n")
    (tmp_path / "plain.yaml").write_text(
        "task: plain\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: 'x'\ndoc_to_target: refs\n"
        "metric_list:\n"
        f"  - metric: clipscore\n    model: {tiny_clip}\n    aggregation: capeval/clipscore\n"
        "  - metric: cider\n    aggregation: capeval/cider\n")
    tasks = tasks_only(str(tmp_path)).load(["plain"]) if hasattr(TaskManager, "load") else None
    if tasks is None:
        from lm_eval.tasks import get_task_dict

        tasks = get_task_dict(["plain"], tasks_only(str(tmp_path)))
    with pytest.raises(InputError) as err:
        check_tasks(tasks)
    assert "clipscore scores images, which this task does not pass" in str(err.value)
    assert "doc_to_target gives a list" in str(err.value)


def test_capeval_lm_eval_help_and_a_missing_caption_file_are_one_liners(tmp_path):
    help_run = subprocess.run([str(Path(PYTHON).parent / "capeval-lm-eval"), "--help"], capture_output=True,
                              text=True, timeout=HANG_GUARD)
    assert help_run.returncode == 0 and "capeval metric" in help_run.stdout and "--tasks" in help_run.stdout
    # without lm-eval (help prints, anything else names the extra): tests/test_base_install.py, on a base install
    no_metadata = subprocess.run([str(Path(PYTHON).parent / "capeval-lm-eval"), "--model", "dummy", "--tasks",
                                  "capeval_caption"], capture_output=True, text=True, timeout=HANG_GUARD)
    assert no_metadata.returncode == 2 and "Traceback" not in no_metadata.stderr
    assert no_metadata.stderr.strip().splitlines()[-1].startswith("capeval-lm-eval: error: capeval_caption needs a "
                                                                  "caption file: --metadata")


@pytest.mark.parametrize("case", ["misspelled option", "empty caption file"])
def test_capeval_lm_eval_refuses_a_bad_metadata_in_one_line(tmp_path, case):
    import json

    captions = tmp_path / "captions.jsonl"
    if case == "empty caption file":
        captions.write_text("")
        metrics = {"cider": {}}
    else:
        captions.write_text((EXAMPLES / "captions.jsonl").read_text())
        metrics = {"cider": {"tokenise": False}}
    metadata = json.dumps({"captions": str(captions), "images": str(EXAMPLES / "images"), "metrics": metrics})
    proc = subprocess.run([str(Path(PYTHON).parent / "capeval-lm-eval"), "--model", "dummy", "--tasks",
                           "capeval_caption", "--metadata", metadata], capture_output=True, text=True,
                          timeout=HANG_GUARD)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    expected = "unknown option(s) ['tokenise']" if case == "misspelled option" else "holds no captions"
    assert last.startswith("capeval-lm-eval: error: ") and expected in last


def test_aggregate_scores_images_in_every_form_the_core_takes(tiny_clip):
    """Its corpus key read any object with ``tobytes`` and ``size`` as a PIL image: numpy images raised
    AttributeError; the key is now the contract's pixel digest, one for every form of one image."""
    import numpy as np
    import torch

    from capeval_plugins.lm_eval import CaptionItem, aggregate

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (30, 30, 3), dtype=np.uint8) for _ in range(3)]
    cands, refs = ["a dog runs", "a cat sits", "a red car"], [["a dog"], ["a cat"], ["a car"]]
    direct = capeval_plugins.load("refclipscore", model=tiny_clip)(arrays, cands, refs).score
    for images in (arrays, [torch.from_numpy(a) for a in arrays]):
        got = aggregate("refclipscore", [CaptionItem(im, c, r) for im, c, r in zip(images, cands, refs)],
                        model=tiny_clip)
        assert got == pytest.approx(direct, abs=1e-6)


def test_aggregate_scores_again_when_an_image_file_or_the_model_changed(tiny_clip, tmp_path):
    """Scores are kept for the other aggregations of one scoring, keyed by the corpus: an image file written
    again at its path, or a model folder rebuilt in place, gave the numbers of before."""
    import shutil

    from capeval_plugins.lm_eval import CaptionItem, aggregate
    from capeval_plugins.resources.loading import clear_cache
    from capeval_plugins.testing import build_tiny
    from conftest import random_image

    model = tmp_path / "clip"
    shutil.copytree(tiny_clip, model)
    paths = [tmp_path / f"{k}.png" for k in range(3)]
    for k, path in enumerate(paths):
        random_image(k).save(path)
    cands, refs = ["a dog runs", "a cat sits", "a red car"], [["a dog"], ["a cat"], ["a car"]]

    def score() -> float:
        return aggregate("clipscore", [CaptionItem(str(p), c, r) for p, c, r in zip(paths, cands, refs)],
                         model=str(model))

    def fresh() -> float:
        return capeval_plugins.load("clipscore", model=str(model))([str(p) for p in paths], cands).score

    before = score()
    random_image(9).save(paths[0])
    os.utime(paths[0], ns=(10**9, 10**9))
    assert score() == pytest.approx(fresh(), abs=1e-6) != pytest.approx(before, abs=1e-6)
    after_image = score()
    build_tiny("clip", tmp_path / "other", seed=5)
    shutil.copy(tmp_path / "other" / "model.safetensors", model / "model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the process's model is loaded again, with a warning)
        assert score() == pytest.approx(fresh(), abs=1e-6) != pytest.approx(after_image, abs=1e-6)
    clear_cache()
