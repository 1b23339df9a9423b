"""lm-eval: metrics registered beside the built-ins; the shipped caption task scores a captioner."""
from __future__ import annotations

import pytest
from conftest import EXAMPLES, PYTHON, run

import capeval_plugins
from capeval_plugins.caption_files import read_captions

lm_eval = pytest.importorskip("lm_eval")


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


def _captioner():
    from lm_eval.api.model import LM

    records = read_captions(EXAMPLES / "captions.jsonl", EXAMPLES / "images")

    class Captioner(LM):
        MULTIMODAL = True

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            return [records.captions[r.doc["id"]] for r in requests]

    return Captioner(), records


@pytest.mark.slow
def test_caption_task_scores_the_generations(tiny_clip):
    from lm_eval.tasks import TaskManager

    from capeval_plugins.adapters.lm_eval import tasks_dir

    model, records = _captioner()
    metadata = {"captions": str(EXAMPLES / "captions.jsonl"), "images": str(EXAMPLES / "images"),
                "metrics": {"clipscore": {"model": tiny_clip}, "capeval/refclipscore": {"model": tiny_clip}}}
    out = lm_eval.simple_evaluate(model=model, tasks=["capeval_caption"],
                                  task_manager=TaskManager(include_path=str(tasks_dir()), metadata=metadata))
    got = out["results"]["capeval_caption"]
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(records.images, records.captions, records.references)
    assert got["clipscore,none"] == pytest.approx(direct.score, abs=1e-6)
    assert got["capeval/refclipscore,none"] == pytest.approx(direct.corpus_extras["mean_refclipscore"], abs=1e-6)


@pytest.mark.slow
def test_task_yaml_can_be_included_with_other_options(tiny_clip, tmp_path):
    """The lm-eval way to change metrics: a YAML that includes the shipped one."""
    from lm_eval.tasks import TaskManager

    from capeval_plugins.adapters.lm_eval import tasks_dir

    (tmp_path / "mine.yaml").write_text(
        f"include: {tasks_dir() / 'capeval_caption.yaml'}\n"
        "task: my_caption\n"
        "metric_list:\n"
        f"  - metric: clipscore\n    model: {tiny_clip}\n    w: 1.0\n"
        "    aggregation: capeval/clipscore\n    higher_is_better: true\n")
    model, records = _captioner()
    tm = TaskManager(include_path=[str(tasks_dir()), str(tmp_path)],
                     metadata={"captions": str(EXAMPLES / "captions.jsonl"), "images": str(EXAMPLES / "images")})
    out = lm_eval.simple_evaluate(model=model, tasks=["my_caption"], task_manager=tm)
    direct = capeval_plugins.load("clipscore", model=tiny_clip, w=1.0)(records.images, records.captions)
    assert out["results"]["my_caption"]["clipscore,none"] == pytest.approx(direct.score, abs=1e-6)


@pytest.mark.slow
def test_capeval_lm_eval_lists_the_shipped_task():
    from pathlib import Path

    proc = run([str(Path(PYTHON).parent / "capeval-lm-eval"), "ls", "tasks"], timeout=300)
    assert "capeval_caption" in proc.stdout


def test_an_empty_generation_costs_its_document_not_the_aggregation():
    import warnings

    from capeval_plugins.adapters.lm_eval import CaptionItem, aggregate
    from capeval_plugins.inputs import InputError

    refs = [["a dog runs on grass"], ["a cat sits"], ["a red car"], ["two birds fly"]]
    captions = ["a dog runs", "", "a red car", "birds flying"]
    items = [CaptionItem(None, c, r) for c, r in zip(captions, refs)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = aggregate("cider", items, tokenize=False)
    said = [str(w.message) for w in caught if "documents not scored" in str(w.message)]
    assert len(said) == 1 and "1 of 4 documents not scored (document 1: caption is empty)" in said[0]
    kept = [0, 2, 3]
    expected = capeval_plugins.load("cider", tokenize=False)(None, [captions[i] for i in kept], [refs[i] for i in kept])
    assert got == pytest.approx(expected.score, rel=1e-12)
    with pytest.raises(InputError, match="sample 1: caption is empty"):
        aggregate("cider", items, tokenize=False, on_error="raise")
