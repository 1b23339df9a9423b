"""Hugging Face evaluate: offline load by plain name with no import of ours, canonical names untouched."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from conftest import CAPTIONS, HANG_GUARD, PYTHON, REFERENCES, run

import capeval_plugins
from capeval_plugins import registry
from capeval_plugins.adapters import hf_evaluate


def test_plain_name_loads_in_a_fresh_interpreter_offline_without_network(tiny_clip, tmp_path):
    """The .pth start-up hook resolves the name; a socket guard proves no network call is attempted."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(f"""
        import json, socket, sys
        calls = []
        def guard(*args, **kwargs):
            calls.append(args)
            raise OSError("network disabled in this test")
        socket.socket.connect = guard
        socket.getaddrinfo = guard
        import evaluate
        assert "capeval_plugins.contract" not in sys.modules  # nothing of ours imported yet
        from PIL import Image
        images = [Image.new("RGB", (20, 20), c) for c in ("red", "blue")]
        out = {{}}
        for name in ("clipscore", "capeval/clipscore"):
            metric = evaluate.load(name, model={tiny_clip!r})
            out[name] = metric.compute(images=images, predictions=["a red square", "a blue square"])
        print(json.dumps({{"calls": len(calls), "results": out, "module": metric.name}}))
    """))
    proc = run([PYTHON, str(script)], env={"HF_EVALUATE_OFFLINE": "0", "HF_HUB_OFFLINE": "0"}, cwd=str(tmp_path))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["calls"] == 0
    assert report["module"] == "clipscore"
    a, b = report["results"]["clipscore"], report["results"]["capeval/clipscore"]
    assert a["scores"] == pytest.approx(b["scores"]) and len(a["scores"]) == 2


def test_compute_equals_direct_call_and_add_batch(tiny_clip, images):
    import evaluate

    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS, REFERENCES).to_dict()
    metric = evaluate.load("clipscore", model=tiny_clip)
    out = metric.compute(images=images, predictions=CAPTIONS, references=REFERENCES)
    assert set(out) == set(direct)
    assert out["scores"] == pytest.approx(direct["scores"], abs=1e-6)
    assert out["clipscore"] == pytest.approx(direct["clipscore"], abs=1e-6)
    metric.add_batch(images=images[:2], predictions=CAPTIONS[:2], references=REFERENCES[:2])
    metric.add_batch(images=images[2:], predictions=CAPTIONS[2:], references=REFERENCES[2:])
    assert metric.compute()["scores"] == pytest.approx(direct["scores"], abs=1e-6)


def test_tensor_images_and_string_references(tiny_clip, images):
    import evaluate
    import numpy as np

    tensors = [torch.from_numpy(np.array(img)).permute(2, 0, 1) for img in images]
    single_refs = [r[0] for r in REFERENCES]
    direct = capeval_plugins.load("refclipscore", model=tiny_clip)(images, CAPTIONS, single_refs)
    out = evaluate.load("capeval/refclipscore", model=tiny_clip).compute(
        images=tensors, predictions=CAPTIONS, references=single_refs)
    assert out["scores"] == pytest.approx(direct.scores.tolist(), abs=1e-6)


def test_info_carries_citation_features_and_card(tiny_clip):
    import evaluate

    metric = evaluate.load("clipscore", model=tiny_clip)
    assert "hessel2021clipscore" in metric.citation
    assert set(metric.features[0]) == {"predictions", "references", "images", "ids"}  # ids: optional
    assert "## How to Use" in metric.inputs_description  # the metric card
    assert "How to Use" in metric.compute.__doc__


def test_bad_options_and_inputs_are_reported(tiny_clip, images):
    import evaluate

    with pytest.raises(TypeError, match="unknown option"):
        evaluate.load("clipscore", modle=tiny_clip)
    metric = evaluate.load("clipscore", model=tiny_clip)
    with pytest.raises(ValueError, match="sample 1: caption contains a NUL"):
        metric.compute(images=images[:2], predictions=["fine", "a\x00b"])


def test_canonical_names_are_never_shadowed():
    class Bleu(capeval_plugins.load("clipscore").__class__):
        info = capeval_plugins.load("clipscore").info.__class__(
            name="bleu", display_name="Bleu", description="", citation="", references="always", images="never")

    class Plugin:
        @staticmethod
        @registry.hookimpl
        def capeval_metrics():
            return [Bleu]

    registry.register_plugin(Plugin, name="test-shadow")
    try:
        assert hf_evaluate.importable_module("bleu") is None  # evaluate's own bleu stays
        assert hf_evaluate.importable_module("capeval/bleu") is not None
        assert "bleu" not in hf_evaluate.evaluate_names() and "capeval/bleu" in hf_evaluate.evaluate_names()
    finally:
        registry.plugin_manager().unregister(name="test-shadow")
        registry.refresh()


def test_module_file_fallback_loads_without_the_hook(tiny_clip, tmp_path, images):
    import evaluate

    path = hf_evaluate.module_file("clipscore", tmp_path)
    assert (path.parent / "README.md").is_file()
    metric = evaluate.load(str(path), model=tiny_clip)
    out = metric.compute(images=images, predictions=CAPTIONS)
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS)
    assert out["scores"] == pytest.approx(direct.scores.tolist(), abs=1e-6)


def test_importing_capeval_plugins_imports_no_ecosystem(tmp_path):
    proc = run([PYTHON, "-c", textwrap.dedent("""
        import sys, capeval_plugins
        capeval_plugins.list_metrics()
        bad = [m for m in ("evaluate", "lm_eval", "pycocoevalcap", "lightning", "pytorch_lightning", "torchmetrics")
               if m in sys.modules]
        print(bad)
    """)])
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("keep_in_memory", [False, True])
def test_a_refused_batch_leaks_nothing_into_the_next_compute(tiny_clip, images, keep_in_memory):
    import evaluate

    from capeval_plugins.inputs import InputError

    metric = evaluate.load("clipscore", model=tiny_clip, keep_in_memory=keep_in_memory)
    metric.add_batch(images=images[:2], predictions=CAPTIONS[:2])
    with pytest.raises(InputError) as err:
        metric.add_batch(images=images[2:], predictions=["c", None])
    assert "the 2 samples added before were discarded" in "\n".join(err.value.__notes__)
    out = metric.compute(images=images[1:4], predictions=CAPTIONS[1:4])
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images[1:4], CAPTIONS[1:4])
    assert len(out["scores"]) == 3
    assert out["scores"] == pytest.approx(direct.scores.tolist(), abs=1e-6)
    # a compute that fails keeps nothing either
    metric.add_batch(images=images[:2], predictions=CAPTIONS[:2])
    with pytest.raises(InputError) as err:
        metric.compute(images=images[:1], predictions=["a\x00b"])
    assert "the 2 samples added before were discarded" in "\n".join(err.value.__notes__)  # not 3: its own input
    assert len(metric.compute(images=images[:1], predictions=CAPTIONS[:1])["scores"]) == 1
    with pytest.raises(InputError) as err:  # nothing added before: no note
        metric.compute(images=images[:1], predictions=["a\x00b"])
    assert not getattr(err.value, "__notes__", None)


def test_plain_names_that_are_not_evaluate_modules_are_ours_offline(tmp_path):
    """``evaluate.load("cider")`` in a fresh interpreter, no import of ours, no network: capeval's CIDEr (evaluate
    has no ``cider`` module; without us it would ask the Hub). evaluate's own modules keep their names."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent("""
        import json, socket
        def guard(*args, **kwargs):
            raise OSError("network disabled in this test")
        socket.socket.connect = guard
        socket.getaddrinfo = guard
        import evaluate
        cider = evaluate.load("cider", tokenize=False)
        out = cider.compute(predictions=["a dog runs on grass", "", "a red car"],
                            references=[["a dog on grass", "a brown dog"], ["a cat"], ["a red car parked"]])
        print(json.dumps({"module": type(cider).__module__, "out": out}))
    """))
    proc = run([PYTHON, str(script)], env={"HF_EVALUATE_OFFLINE": "0", "HF_HUB_OFFLINE": "0"}, cwd=str(tmp_path))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    direct = capeval_plugins.load("cider", tokenize=False)(
        None, ["a dog runs on grass", "", "a red car"], [["a dog on grass", "a brown dog"], ["a cat"], ["a red car parked"]])
    assert report["module"].startswith("capeval_plugins") and report["out"]["cider"] == pytest.approx(direct.score)
    assert report["out"]["scores"][1] == 0.0  # the empty caption: scored, 0 as pycocoevalcap
    for name in ("cider", "clipscore", "refclipscore", "bleu4", "rouge_l", "mid"):
        assert hf_evaluate.importable_module(name) is not None, name
    for name in ("meteor", "bertscore", "bleu", "rouge"):  # evaluate's own
        assert hf_evaluate.importable_module(name) is None, name


OTHER_MODULE = '''
import datasets
import evaluate

class CaptionWords(evaluate.Metric):
    """A module written the way evaluate's own are: predictions and references, nothing else."""

    def _info(self):
        return evaluate.MetricInfo(description="", citation="", inputs_description="",
                                   features=datasets.Features({"predictions": datasets.Value("string"),
                                                               "references": datasets.Sequence(datasets.Value("string"))}))

    def _compute(self, predictions, references):
        return {"mean_words": sum(len(p.split()) for p in predictions) / len(predictions)}
'''


def test_combine_with_evaluates_own_modules_takes_images(tiny_clip, images, tmp_path):
    """``evaluate.combine([their module, "clipscore"]).compute(..., images=...)``: the images reach only the
    modules that take them (evaluate would hand them to every module, and its own fail on them)."""
    import evaluate

    folder = tmp_path / "caption_words"
    folder.mkdir()
    (folder / "caption_words.py").write_text(OTHER_MODULE)
    combined = evaluate.combine([evaluate.load(str(folder)), evaluate.load("clipscore", model=tiny_clip)])
    out = combined.compute(predictions=CAPTIONS, references=REFERENCES, images=images)
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS, REFERENCES)
    assert out["clipscore"] == pytest.approx(direct.score, abs=1e-6)
    assert out["mean_words"] == pytest.approx(sum(len(c.split()) for c in CAPTIONS) / len(CAPTIONS))
    combined.add_batch(predictions=CAPTIONS, references=REFERENCES, images=images)  # evaluate's own routing
    assert combined.compute()["clipscore"] == pytest.approx(direct.score, abs=1e-6)


def test_compute_time_options_follow_evaluates_convention(tiny_clip, images):
    import evaluate

    metric = evaluate.load("clipscore", model=tiny_clip)
    out = metric.compute(images=images, predictions=CAPTIONS, w=1.0)
    direct = capeval_plugins.load("clipscore", model=tiny_clip, w=1.0)(images, CAPTIONS)
    assert out["clipscore"] == pytest.approx(direct.score, abs=1e-6)
    assert metric.compute(images=images, predictions=CAPTIONS)["clipscore"] == pytest.approx(
        capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS).score, abs=1e-6)  # not kept
    with pytest.raises(TypeError, match="unknown option"):
        metric.compute(images=images, predictions=CAPTIONS, wieght=1.0)


@pytest.mark.parametrize("variable", ["CAPEVAL_CACHE", "XDG_CACHE_HOME"])
def test_module_file_writes_under_the_cache_the_environment_names(tmp_path, monkeypatch, variable):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CAPEVAL_CACHE", raising=False)
    monkeypatch.setenv(variable, str(tmp_path / "cache"))
    path = hf_evaluate.module_file("cider")
    root = tmp_path / "cache" if variable == "CAPEVAL_CACHE" else tmp_path / "cache" / "capeval_plugins"
    assert path == root / "evaluate_modules" / "cider" / "cider.py" and path.is_file()
    assert not (tmp_path / "home").exists()


def test_a_skipped_sample_is_counted_in_the_output(tiny_clip, images, tmp_path):
    """``on_error="skip"``: a sample that cannot be scored (a missing image file) is left out of the corpus score,
    and the output says so itself (``n_skipped``, ``skipped``), not only a warning; an empty caption is scored."""
    import evaluate

    metric = evaluate.load("clipscore", model=tiny_clip, on_error="skip")
    out = metric.compute(images=[images[0], str(tmp_path / "missing.png"), images[2]],
                         predictions=[CAPTIONS[0], CAPTIONS[1], ""])
    assert out["n_skipped"] == 1 and list(out["skipped"]) == [1] and "image file not found" in out["skipped"][1]
    assert out["scores"][1] != out["scores"][1] and out["scores"][2] == out["scores"][2]  # NaN; the empty one scored


def test_other_adapters_spellings_load_the_metric():
    """``evaluate.load("CIDEr")`` (pycocoevalcap's method name), ``"ClipScore"``, ``"CLIPScore"`` find the metric
    the other adapters find under those names; a spelling of a canonical evaluate module stays evaluate's."""
    import evaluate

    for spelling, name in (("CIDEr", "cider"), ("Cider", "cider"), ("ClipScore", "clipscore"),
                           ("CLIPScore", "clipscore"), ("capeval/CIDEr", "cider"), ("capeval/METEOR", "meteor")):
        found = hf_evaluate.importable_module(spelling)
        assert found is not None and found.module_path.endswith("." + name), spelling
    for spelling in ("METEOR", "BERTScore", "Meteor"):
        assert hf_evaluate.importable_module(spelling) is None, spelling
    preds, refs = ["a dog runs on grass", "", "a red car"], [["a dog on grass", "a brown dog"], ["a cat"],
                                                             ["a red car parked"]]
    out = evaluate.load("CIDEr", tokenize=False).compute(predictions=preds, references=refs)
    direct = capeval_plugins.load("cider", tokenize=False)(None, preds, refs)
    assert out["scores"] == pytest.approx(direct.scores.tolist(), abs=1e-12)


def _process(rank: int, world: int, name: str, idx: list[int], predictions, references, cache_dir: str,
             with_ids: bool, experiment: str, out: str, main_ready, others_ready) -> None:
    import warnings

    import evaluate

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = evaluate.load(name, tokenize=False, num_process=world, process_id=rank, cache_dir=cache_dir,
                               experiment_id=experiment)
        # evaluate checks, without waiting, that process 0 holds its file when another writes, and that every
        # process holds its file when process 0 computes: the ranks start in that order
        if rank:
            main_ready.wait(timeout=HANG_GUARD)
        module.add_batch(predictions=[predictions[k] for k in idx], references=[references[k] for k in idx],
                         **({"ids": idx} if with_ids else {}))
        if rank:
            others_ready.set()
        else:
            main_ready.set()
            others_ready.wait(timeout=HANG_GUARD)
        result = module.compute()
    with open(f"{out}/rank{rank}.json", "w") as handle:
        json.dump({"result": result, "warnings": [str(w.message) for w in caught]}, handle)


def _processes(name: str, shards: dict[int, list[int]], predictions, references, cache_dir, with_ids: bool,
               experiment: str) -> dict:
    """evaluate's ``num_process`` mechanism, one forked process per rank: each adds its shard, process 0 gathers
    (evaluate synchronises them through lock files in ``cache_dir``, held per process)."""
    import multiprocessing

    cache_dir.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("fork")
    main_ready, others_ready = context.Event(), context.Event()  # two ranks: one event for the others is enough
    procs = [context.Process(target=_process, args=(rank, len(shards), name, shards[rank], predictions, references,
                                                    str(cache_dir), with_ids, experiment, str(cache_dir), main_ready,
                                                    others_ready))
             for rank in sorted(shards)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=HANG_GUARD)
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return {rank: json.loads((cache_dir / f"rank{rank}.json").read_text()) for rank in shards}


def test_num_process_rows_come_back_in_input_order_with_ids(tmp_path):
    """Two processes (forked) holding interleaved samples (a DistributedSampler's split): given their ids, the
    per-sample scores come back in input order, equal to one process; without ids, in process order, with a
    warning that says so. ``add()`` one sample at a time gives the same."""
    import evaluate

    preds = ["a dog runs on grass", "a cat sleeps", "", "a red car", "two kids play in a park"]
    refs = [["a dog on grass", "a brown dog"], ["a cat on a sofa"], ["a cat"], ["a red car parked"],
            ["children playing", "kids in a park"]]
    single = evaluate.load("cider", tokenize=False).compute(predictions=preds, references=refs)["scores"]
    order = [3, 0, 4, 1, 2]  # in one process: rows added in any order come back in the order of their ids
    shuffled = evaluate.load("cider", tokenize=False).compute(predictions=[preds[k] for k in order],
                                                              references=[refs[k] for k in order], ids=order)
    assert shuffled["scores"] == pytest.approx(single, abs=1e-12)
    one_by_one = evaluate.load("cider", tokenize=False)
    for k in order:
        one_by_one.add(prediction=preds[k], reference=refs[k], id=k)
    assert one_by_one.compute()["scores"] == pytest.approx(single, abs=1e-12)


def test_the_installed_start_up_hook_is_this_trees():
    """The wheel installs the hook as a copy (a top-level module the interpreter reads at start-up): a copy older
    than the source would test, and run, the old hook. `make .venv/.installed` reinstalls when it changes."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("capeval_plugins_evaluate_hook")
    assert spec is not None and spec.origin, "the evaluate start-up hook is not installed"
    source = Path(hf_evaluate.__file__).with_name("evaluate_hook.py")
    assert Path(spec.origin).read_bytes() == source.read_bytes(), (
        f"{spec.origin} is not this tree's {source}: reinstall the package (make .venv/.installed)")


def test_a_load_argument_named_like_a_metric_option_reaches_the_metric_or_says_why_not(tiny_clip, images, tmp_path):
    """``evaluate.load(name, seed=3)`` set evaluate's seed and left the metric's at its default, without a word;
    ``cache_dir`` is evaluate.load's own (the module's cache): the metric's goes to compute, and a warning says so."""
    import evaluate

    metric = evaluate.load("msd_score", model=tiny_clip, seed=3)
    assert metric.capeval_metric.config.seed == 3
    direct = capeval_plugins.load("msd_score", model=tiny_clip, seed=3)(images, CAPTIONS)
    out = metric.compute(images=images, predictions=CAPTIONS)
    assert out["scores"] == pytest.approx(direct.scores.tolist(), abs=1e-12)
    with pytest.warns(UserWarning, match="cache_dir given to evaluate.load is evaluate's cache"):
        module = evaluate.load("dino_cycle", cache_dir=str(tmp_path / "evaluate-cache"))
    assert module.capeval_metric.config.cache_dir is None


def test_combine_add_takes_the_singular_names_a_module_add_takes():
    """``evaluate.combine([...]).add(..., id=...)`` kept only the features' own names (``ids``) and dropped
    ``id``, ``image`` and ``group_id``, so samples came back in the order they were added, not by id."""
    import evaluate

    captions = ["a dog runs on grass", "two cats sleep", "a red car", "a man rides a bike"]
    refs = [["a dog running on grass"], ["two cats sleeping"], ["a red car on a road"], ["a man riding"]]
    combined = evaluate.combine([evaluate.load("cider", tokenize=False), evaluate.load("bleu4", tokenize=False)])
    for i in reversed(range(4)):
        combined.add(prediction=captions[i], reference=refs[i], id=i)
    out = combined.compute()
    direct = capeval_plugins.load("cider", tokenize=False)(None, captions, refs)
    assert out["cider_scores"] == pytest.approx(direct.scores.tolist(), abs=1e-12)
