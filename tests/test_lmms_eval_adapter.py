"""lmms-eval: capeval metrics added to a task through lmms-eval's own ``class:`` hook, run end to end offline on
a tiny LLaVA (lmms-eval's ``llava_hf`` model) captioning a handful of local images.

lmms-eval is an optional extra (``pip install -e '.[lmms]'``): everything here skips without it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLES, HANG_GUARD, free_port, run

import capeval_plugins

try:  # a broken install (e.g. a CUDA torchvision beside a CPU torch) fails with other errors than ImportError
    import lmms_eval.api.task  # noqa: F401
except Exception as err:  # noqa: BLE001
    pytest.skip(f"lmms_eval is not importable: {err}", allow_module_level=True)

from capeval_plugins.adapters import lmms_eval as adapter  # noqa: E402

TASK = "tiny_caption"


def tasks_only(include, **kwargs):
    """A TaskManager of the given task folders alone: indexing lmms-eval's own tasks too takes seconds."""
    from lmms_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=False, **kwargs)


@pytest.fixture(scope="module")
def tiny_llava(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("llava", root=tiny_root))


def write_task(root: Path, images: list, names: list[str], references: list[list[str]], metric_list: str) -> Path:
    """A local dataset (one row per image: the image, its name, its references) and a task YAML scoring it with
    the capeval metrics of ``metric_list`` (YAML); returns the include folder."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "name": datasets.Value("string"),
                                  "sentences": datasets.Sequence(datasets.Value("string"))})
    ds = datasets.Dataset.from_dict({"image": images, "name": names, "sentences": references}, features=features)
    ds.to_parquet(root / "test.parquet")
    (root / "tasks").mkdir()
    (root / "tasks" / "tiny.yaml").write_text(f"""
task: {TASK}
class: !function capeval_plugins.adapters.lmms_eval.CaptionTask
dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {root / 'test.parquet'}
test_split: test
output_type: generate_until
doc_to_visual: !function capeval_plugins.lmms_eval_tasks.utils.doc_to_image
doc_to_text: "Describe the image briefly."
doc_to_target: sentences
generation_kwargs:
  max_new_tokens: 8
  do_sample: false
capeval_references: sentences
metric_list:
{metric_list}""")
    return root / "tasks"


@pytest.fixture(scope="module")
def caption_task(tmp_path_factory, tiny_clip) -> Path:
    """The example images (one row each, with their references), scored with two pointwise capeval metrics and
    a corpus one (MID), all on one CLIP; returns the include folder."""
    from PIL import Image

    refs: dict[str, list[str]] = {}
    for line in (EXAMPLES / "captions.jsonl").read_text().splitlines():
        row = json.loads(line)
        refs.setdefault(row["image"], row["references"])
    images = [Image.open(EXAMPLES / "images" / k).convert("RGB") for k in refs]
    return write_task(tmp_path_factory.mktemp("lmms"), images, list(refs), list(refs.values()), f"""\
  - metric: clipscore
    model: {tiny_clip}
  - metric: capeval/refclipscore
    model: {tiny_clip}
    w: 2.0
  - metric: mid
    model: {tiny_clip}
    covariance_eps: 1.0e-3
""")


def _dataset(include: Path):
    import datasets

    return datasets.load_dataset("parquet", data_files={"test": str(include.parent / "test.parquet")})["test"]


def _evaluate(tiny_llava: str, include: Path, force_simple: bool) -> dict:
    from lmms_eval import evaluator

    return evaluator.simple_evaluate(
        model="llava_hf", model_args=f"pretrained={tiny_llava},dtype=float32,device_map=cpu", tasks=[TASK],
        task_manager=tasks_only(str(include)), log_samples=True, device="cpu", batch_size=1,
        force_simple=force_simple)


def _direct(tiny_clip: str, include: Path, captions: dict[int, str]) -> dict:
    """The same metrics through ``capeval_plugins.load`` on the captions lmms-eval logged, in document order."""
    docs = _dataset(include)
    ids = sorted(captions)
    images = [docs[i]["image"].convert("RGB") for i in ids]
    refs = [docs[i]["sentences"] for i in ids]
    cands = [captions[i] for i in ids]
    metrics = {"clipscore": capeval_plugins.load("clipscore", model=tiny_clip),
               "capeval/refclipscore": capeval_plugins.load("refclipscore", model=tiny_clip, w=2.0),
               "mid": capeval_plugins.load("mid", model=tiny_clip, covariance_eps=1e-3)}
    return {name: metric(images, cands, refs).score for name, metric in metrics.items()}


@pytest.mark.slow
def test_task_scores_equal_capeval_load_on_the_same_captions(tiny_llava, tiny_clip, caption_task, monkeypatch):
    """Each metric's number in lmms-eval's results equals the metric run directly (``capeval_plugins.load``)
    on the generated captions, the documents' images and their references; the images the task loaded for the
    model are the ones scored (the task's doc_to_visual runs once per document)."""
    from collections import Counter

    import capeval_plugins.lmms_eval_tasks.utils as task_utils

    loads = Counter()
    real = task_utils.doc_to_image

    def counting(doc):
        loads[doc["name"]] += 1
        return real(doc)

    monkeypatch.setattr(task_utils, "doc_to_image", counting)
    out = _evaluate(tiny_llava, caption_task, force_simple=False)
    assert sorted(loads.values()) == [1, 1, 1, 1]
    samples = out["samples"][TASK]
    assert sorted(s["doc_id"] for s in samples) == [0, 1, 2, 3]
    captions = {s["doc_id"]: s["filtered_resps"][0].strip() for s in samples}
    direct = _direct(tiny_clip, caption_task, captions)
    got = out["results"][TASK]
    for name, value in direct.items():
        assert got[f"{name},none"] == pytest.approx(value, abs=1e-9), name
    assert out["higher_is_better"][TASK]["clipscore"] is True


@pytest.mark.parametrize("task_type", ["chat", "simple"])
def test_task_is_built_for_the_kind_of_model_lmms_eval_runs(caption_task, task_type):
    """lmms-eval builds chat models' tasks as ConfigurableMessagesTask and simple models' as ConfigurableTask;
    a ``class:`` task gets the same treatment, with our metrics added and the documents numbered."""
    from lmms_eval.api.task import ConfigurableMessagesTask

    task = tasks_only(str(caption_task)).load_task_or_group([TASK], task_type=task_type)[TASK]
    assert isinstance(task, ConfigurableMessagesTask) == (task_type == "chat")
    names = {"clipscore", "capeval/refclipscore", "mid"}
    assert set(task.aggregation()) == names | {f"{n}_n_skipped" for n in names}
    assert task.eval_docs[2][adapter.DOC_ID] == 2 and task.eval_docs_no_media[3][adapter.DOC_ID] == 3


_DIST_SCRIPT = """
import json, os, sys
import torch.distributed as dist
if int(os.environ.get("WORLD_SIZE", 1)) > 1:
    dist.init_process_group("gloo")
from lmms_eval import evaluator
from lmms_eval.tasks import TaskManager
llava, include, out_path = sys.argv[1:4]
out = evaluator.simple_evaluate(model="llava_hf", model_args=f"pretrained={llava},dtype=float32,device_map=cpu",
    tasks=["%s"], task_manager=TaskManager(include_path=include, include_defaults=False), log_samples=True,
    device="cpu", batch_size=1,
    distributed_executor_backend="torchrun" if dist.is_initialized() else "accelerate")
if out is not None:
    samples = {s["doc_id"]: s["filtered_resps"][0].strip() for s in out["samples"]["%s"]}
    json.dump({"results": out["results"]["%s"], "captions": samples}, open(out_path, "w"), default=str)
""" % (TASK, TASK, TASK)


@pytest.mark.slow
def test_two_processes_score_the_corpus_one_process_scores(tiny_llava, tiny_clip, caption_task, tmp_path):
    """torchrun with 2 gloo processes: each generates half the documents, rank 0 gathers the items and scores
    the whole split in document order, so the corpus scores equal one process's and the direct computation."""
    import runpy

    script = tmp_path / "run.py"
    script.write_text(_DIST_SCRIPT)
    args = [tiny_llava, str(caption_task)]
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(script), *args, str(tmp_path / "out2.json")], timeout=HANG_GUARD)
    # one process: the same script in this one (what torchrun --nproc_per_node 1 runs, without three interpreters)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(script), *args, str(tmp_path / "out1.json")])
        runpy.run_path(str(script), run_name="__main__")
    outs = {n: json.loads((tmp_path / f"out{n}.json").read_text()) for n in (1, 2)}
    assert outs[1]["captions"] == outs[2]["captions"]  # greedy decoding: the same captions either way
    direct = _direct(tiny_clip, caption_task, {int(k): v for k, v in outs[2]["captions"].items()})
    for name, value in direct.items():
        assert outs[2]["results"][f"{name},none"] == pytest.approx(outs[1]["results"][f"{name},none"], abs=1e-12)
        assert outs[2]["results"][f"{name},none"] == pytest.approx(value, abs=1e-9)


def test_base_task_keeps_its_metrics_and_adds_ours():
    """``base_task`` takes lmms-eval's own task config (found by name, functions resolved) and appends ours."""
    config = adapter._resolve_base({"base_task": "coco_karpathy_test", "task": "mine",
                                    "metric_list": [{"metric": "clipscore", "model": "m"}]})
    names = [m["metric"] for m in config["metric_list"]]
    assert names[-1] == "clipscore" and "coco_CIDEr" in names and "coco_Bleu_4" in names
    assert callable(config["process_results"]) and config["task"] == "mine"
    with pytest.raises(ValueError, match="not one of lmms-eval's tasks"):
        adapter._base_config("no_such_task_anywhere")


def test_shipped_example_names_registered_metrics_with_valid_options():
    import dataclasses

    from lmms_eval.utils import load_yaml_config

    from capeval_plugins import registry
    from capeval_plugins.adapters.harness import split_metric_list

    config = load_yaml_config(str(adapter.tasks_dir() / "coco_karpathy_test_capeval.yaml"), mode="full")
    assert config["class"] is adapter.CaptionTask and config["base_task"] == "coco_karpathy_test"
    ours, others = split_metric_list(config["metric_list"])
    assert [e.name for e in ours] == ["clipscore", "refclipscore", "discode"] and not others
    for entry in ours:
        fields = {f.name for f in dataclasses.fields(registry.get(entry.name).cls.Config)}
        assert set(entry.options) <= fields, entry


def test_a_task_without_any_capeval_metric_is_refused():
    with pytest.raises(ValueError, match="no capeval metric"):
        adapter.CaptionTask(config={"task": "x", "metric_list": [{"metric": "exact_match"}]})


def _loaded_task(include: Path):

    return tasks_only(str(include)).load_task_or_group([TASK], task_type="chat")[TASK]


def _items(task, captions: list[str]) -> list[dict]:
    return [task.process_results(task.eval_docs_no_media[i], [c]) for i, c in enumerate(captions)]


def test_all_capeval_metrics_of_a_task_share_one_pass(caption_task, tiny_clip, monkeypatch):
    """lmms-eval calls one aggregation per metric; the first scores the split with every capeval metric of the
    task, the second reuses that pass. The items are text only; the images come from the task's documents."""
    calls = []
    real = adapter.score_documents

    def counting(metrics, *args, **kwargs):
        calls.append(sorted(metrics))
        return real(metrics, *args, **kwargs)

    monkeypatch.setattr(adapter, "score_documents", counting)
    task = _loaded_task(caption_task)
    captions = ["A red ball.", "A blue car on a road.", "A tree.", "The sun."]
    per_doc = _items(task, captions)
    assert all(isinstance(d["clipscore"], adapter.CaptionItem) for d in per_doc)
    items = [d["clipscore"] for d in reversed(per_doc)]  # gathered order does not matter
    scores = {name: fn(items) for name, fn in task.aggregation().items()}
    assert calls == [["capeval/refclipscore", "clipscore", "mid"]]
    docs = _dataset(caption_task)
    direct = capeval_plugins.load("clipscore", model=tiny_clip)([d["image"] for d in docs], captions).score
    assert scores["clipscore"] == pytest.approx(direct, abs=1e-9)


def test_a_bad_generation_costs_its_document_and_is_named(caption_task, tmp_path):
    """As in lm-eval: a generation no metric can take (a NUL) is skipped with a warning naming the document by
    default (the score is the one over the other documents) and counted in the results (``clipscore_n_skipped``);
    ``on_error: raise`` in the metric_list entry stops instead, naming the document."""
    from capeval_plugins.inputs import InputError

    captions = ["A red ball.", "A\x00tree", "", "The sun."]  # the empty one is scored
    task = _loaded_task(caption_task)
    items = [d["clipscore"] for d in _items(task, captions)]
    with pytest.warns(UserWarning, match="1 of 4 documents not scored.*document 1"):
        got = task.aggregation()["clipscore"](items)
    assert task.aggregation()["clipscore_n_skipped"](items) == 1.0
    fresh = _loaded_task(caption_task)
    kept = [d["clipscore"] for i, d in enumerate(_items(fresh, captions)) if i != 1]
    assert got == pytest.approx(fresh.aggregation()["clipscore"](kept), abs=1e-9)

    strict = tmp_path / "tasks"
    strict.mkdir()
    yaml = (caption_task / "tiny.yaml").read_text()
    (strict / "tiny.yaml").write_text(yaml.replace("  - metric: clipscore\n", "  - metric: clipscore\n    on_error: raise\n"))
    task = _loaded_task(tmp_path)
    items = [d["clipscore"] for d in _items(task, captions)]
    with pytest.raises(InputError, match=f"{TASK} document 1"):
        task.aggregation()["clipscore"](items)


def test_every_registered_metric_can_be_named_either_way():
    from capeval_plugins import registry
    from capeval_plugins.adapters.harness import split_metric_list

    names = sorted(registry.metrics())
    entries = [{"metric": n, "batch_size": 4} for n in names] + [{"metric": f"capeval/{names[0]}"},
                                                                {"metric": "coco_CIDEr", "aggregation": "x"}]
    ours, others = split_metric_list(entries)
    assert [e.name for e in ours] == [*names, names[0]] and [o["metric"] for o in others] == ["coco_CIDEr"]
    assert all(e.options == {"batch_size": 4} for e in ours[:-1])


def test_large_photos_score_as_the_reference_computation_on_the_full_image(tiny_clip, tmp_path):
    """The task's aggregation hands CLIP's processor each document's image exactly as the task decoded it:
    photos far above the processor's side and of odd aspect ratios score what the model's own processor and
    forward pass give on the full image (tests/test_one_input.py: the other entry points). The dataset's
    decoder applies a file's EXIF orientation (the rocket photo's), so the metric scores the upright image, the
    one the captioning model is shown."""
    from conftest import LARGE_PHOTO_CAPTIONS, large_photos, reference_clip_cosines
    from PIL import Image, ImageOps

    pytest.importorskip("skimage")
    photos = [str(p) for p in large_photos(tmp_path / "photos")]
    write_task(tmp_path, photos, [Path(p).name for p in photos], [["a reference"]] * len(photos),
               f"  - metric: clipscore\n    model: {tiny_clip}\n")
    task = _loaded_task(tmp_path / "tasks")
    items = [d["clipscore"] for d in _items(task, LARGE_PHOTO_CAPTIONS)]
    got = task.aggregation()["clipscore"](items)
    upright = [ImageOps.exif_transpose(Image.open(p)).convert("RGB") for p in photos]
    expected = 2.5 * reference_clip_cosines(tiny_clip, upright, LARGE_PHOTO_CAPTIONS).clip(min=0)
    assert got == pytest.approx(float(expected.mean()), abs=2.5e-6)
    as_stored = 2.5 * reference_clip_cosines(tiny_clip, photos, LARGE_PHOTO_CAPTIONS).clip(min=0)
    assert abs(float(as_stored.mean()) - float(expected.mean())) > 1e-4  # the tagged photo is a real test


def test_a_metric_model_that_cannot_be_loaded_stops_the_task_before_any_generation(caption_task, tmp_path):
    """The task checks its metrics' needs when it is built, before lmms-eval generates a single caption."""
    from capeval_plugins.preflight import RequirementError

    (tmp_path / "tasks").mkdir()
    yaml = (caption_task / "tiny.yaml").read_text()
    start = yaml.index("metric_list:")
    (tmp_path / "tasks" / "tiny.yaml").write_text(yaml[:start] + "metric_list:\n  - metric: clipscore\n"
                                                   "    model: org/not-cached\n")
    with pytest.raises(RequirementError, match="clipscore: option model: 'org/not-cached' is not a local folder"):
        _loaded_task(tmp_path / "tasks")


@pytest.mark.slow
def test_a_replay_with_empty_generations_gives_lmms_evals_own_coco_cider(tiny_clip, tmp_path, monkeypatch):
    """Twelve real captions, two of them empty (a model that said nothing), replayed through lmms-eval's
    ``from_log`` model on a task that keeps lmms-eval's own COCO metrics: capeval's ``cider`` equals lmms-eval's
    ``coco_CIDEr`` (pycocoevalcap scores the empty ones 0), CLIPScore averages over all twelve, and the results
    count the documents each capeval metric left out (none)."""
    pytest.importorskip("skimage")
    from conftest import has_java
    from lmms_eval import evaluator

    from capeval_plugins.testing.realistic import write_photos

    if not has_java():
        pytest.skip("PTB tokenisation needs Java")
    from PIL import Image

    photos = tmp_path / "photos"
    write_photos(photos)
    rows = [json.loads(line) for line in (EXAMPLES / "photos.jsonl").read_text().splitlines()][:12]
    captions = [r["caption"] if k not in (3, 8) else "" for k, r in enumerate(rows)]
    images = [Image.open(photos / r["image"]).convert("RGB") for r in rows]
    import datasets

    features = datasets.Features({"image": datasets.Image(), "question_id": datasets.Value("string"),
                                  "id": datasets.Value("int64"), "answer": datasets.Sequence(datasets.Value("string"))})
    datasets.Dataset.from_dict({"image": images, "question_id": [f"COCO_val2014_{k + 1:012d}.jpg" for k in range(12)],
                                "id": list(range(12)), "answer": [r["references"] for r in rows]},
                               features=features).to_parquet(tmp_path / "test.parquet")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "replay.yaml").write_text(f"""
task: replay_caption
class: !function capeval_plugins.adapters.lmms_eval.CaptionTask
dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {tmp_path / 'test.parquet'}
test_split: test
output_type: generate_until
doc_to_visual: !function capeval_plugins.lmms_eval_tasks.utils.doc_to_image
doc_to_text: "Provide a one-sentence caption for the provided image."
doc_to_target: answer
process_results: !function lmms_eval.tasks.coco_cap.utils.coco_process_result
capeval_references: answer
metric_list:
  - metric: coco_CIDEr
    aggregation: !function lmms_eval.tasks.coco_cap.utils.coco_cider
    higher_is_better: true
  - metric: cider
  - metric: clipscore
    model: {tiny_clip}
""")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "replay.json").write_text(json.dumps({
        "args": {"model": "llava", "model_args": "", "limit": None}, "model_configs": {"task": "replay_caption"},
        "time": "0101_0000", "logs": [{"doc_id": k, "resps": [[c]]} for k, c in enumerate(captions)]}))
    monkeypatch.chdir(tmp_path)  # lmms-eval's COCO aggregation writes a submission file under the working folder
    out = evaluator.simple_evaluate(model="from_log", model_args=f"logs={logs}", tasks=["replay_caption"],
                                    task_manager=tasks_only(str(tmp_path / "tasks")), device="cpu",
                                    batch_size=1)
    got = out["results"]["replay_caption"]
    assert got["cider,none"] == pytest.approx(got["coco_CIDEr,none"], rel=1e-12)
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, captions)
    assert got["clipscore,none"] == pytest.approx(direct.score, abs=1e-9) and len(direct.scores) == 12
    assert got["cider_n_skipped,none"] == 0 and got["clipscore_n_skipped,none"] == 0
