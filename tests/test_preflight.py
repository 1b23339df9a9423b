"""What a metric needs (its models, Java, extras, files) is checked before the first sample is scored or
generated, by one preflight every entry point uses, and a missing piece is one line naming it and what to do
(the command line exits with 2)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import EXAMPLES, HANG_GUARD, PYTHON

import capeval_plugins
from capeval_plugins import preflight, registry, runner
from capeval_plugins.contract import ModelConfig, Requirement
from capeval_plugins.resources.loading import local_path_problem
from capeval_plugins.core.messages import install_extra
from capeval_plugins.preflight import RequirementError

CAPEVAL = str(Path(PYTHON).parent / "capeval")


def score(*args, env=None):
    return subprocess.run([CAPEVAL, "score", *args, "--captions", str(EXAMPLES / "captions.jsonl"), "--images",
                           str(EXAMPLES / "images"), "--quiet"], capture_output=True, text=True, timeout=HANG_GUARD,
                          env={**os.environ, **(env or {})})


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_missing_java_fails_before_any_sample_is_scored(tiny_clip, tmp_path, monkeypatch):
    """METEOR and the PTB tokenizer run Java at the corpus step, after every batch: its absence is found first."""
    line = one_line(score("-m", "clipscore", "-m", "meteor", "--model", tiny_clip, env={"PATH": str(tmp_path)}))
    assert line.startswith("capeval: error: meteor (PTB tokenisation, METEOR) need a Java runtime and there is no "
                           "`java` on PATH: install Java 8 or later")
    assert "or pass tokenize=False" in line  # the way around it for the tokenizer

    monkeypatch.setenv("PATH", str(tmp_path))
    mapped = []
    clip = capeval_plugins.load("clipscore", model=tiny_clip)
    monkeypatch.setattr(type(clip), "map", lambda self, batch: mapped.append(batch))
    with pytest.raises(RequirementError, match=r"meteor \(PTB tokenisation, METEOR\) need a Java runtime"):
        runner.score_many({"clipscore": clip, "meteor": capeval_plugins.load("meteor")}, [str(EXAMPLES / "images" / p)
                          for p in sorted(os.listdir(EXAMPLES / "images"))][:2], ["a", "b"], [["c"], ["d"]])
    assert not mapped


def test_a_hub_id_typo_fails_in_one_line_without_retrying_the_hub():
    """A model id that is neither a local folder nor in the Hugging Face cache, downloads allowed and no hub
    reachable (or a hub without it): one request, one line; no minute of retries and no traceback."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.run([CAPEVAL, "score", "-m", "clipscore", "--model", "tiny-clipp", "--captions",
                           str(EXAMPLES / "captions.jsonl"), "--images", str(EXAMPLES / "images"), "--quiet"],
                          capture_output=True, text=True, timeout=HANG_GUARD, env=env)
    line = one_line(proc)
    assert "clipscore: option model: 'tiny-clipp' is not a local folder and not in the Hugging Face cache" in line
    assert "./tiny-clipp" in line and "Retrying" not in proc.stderr


def test_offline_a_model_not_in_the_cache_says_downloads_are_off():
    line = one_line(score("-m", "clipscore", "-m", "mid", "--model", "org/not-cached", env={"HF_HUB_OFFLINE": "1"}))
    assert "'org/not-cached' is not a local folder" in line and "HF_HUB_OFFLINE=1" in line
    assert "`hf download org/not-cached`" in line  # huggingface_hub's command (huggingface-cli is gone)
    assert line.count("org/not-cached' is not") == 2  # both metrics named, in one line


def test_a_cached_hub_id_and_a_local_folder_pass(tiny_clip, tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--org--cached" / "snapshots" / "0123"
    snapshot.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert preflight.model_problem("org/cached") is None
    assert preflight.model_problem(tiny_clip) is None
    assert preflight.model_problem("./not/here") == local_path_problem("./not/here")
    assert "downloads are off (local_files_only=True)" in preflight.model_problem("org/other", local_files_only=True)


def test_modules_and_files():
    assert preflight.problem(Requirement("module", "json")) is None
    said = preflight.problem(Requirement("module", "no_such_module_xyz", "option device_map", "pip install it"))
    assert said == "option device_map needs no_such_module_xyz, which is not installed: pip install it"
    assert "which does not exist" in preflight.problem(Requirement("file", "/no/such/file.jar", "SPICE"))


def test_every_metric_declares_the_models_it_names():
    """Each option naming a checkpoint by hub id (a model, a generator) is a requirement, for every registered
    metric that builds with its defaults (a composite's through its parts)."""
    for name, entry in sorted(registry.metrics().items()):
        try:
            metric = entry.cls()
        except (ValueError, RuntimeError):  # Rigel needs a checkpoint
            continue
        cfg = metric.config
        named = {getattr(cfg, key) for key in getattr(cfg, "input_paths", ())
                 if isinstance(getattr(cfg, key), str) and getattr(cfg, key).count("/") == 1}
        if getattr(cfg, "generated_images", None):
            named.discard(getattr(cfg, "generator", None))
        targets = {r.target for r in metric.requirements() if r.kind == "model"}
        assert named <= targets, (name, named - targets)
        if isinstance(cfg, ModelConfig):  # a device_map needs accelerate
            assert Requirement("module", "accelerate", "option device_map", install_extra("accelerate")) in entry.cls(
                device_map="auto").requirements(), name


def test_torchmetrics_checks_when_built(monkeypatch):
    from capeval_plugins.torchmetrics import CLIPScore

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RequirementError, match="clipscore: option model: 'org/not-cached' is not a local folder"):
        CLIPScore(model="org/not-cached")


@pytest.mark.slow
def test_lm_eval_checks_the_metrics_before_generating():
    """The task is built before the model generates: an unreachable metric model stops it there."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    from capeval_plugins.adapters.lm_eval import tasks_dir

    generated = []
    metadata = {"captions": str(EXAMPLES / "captions.jsonl"), "images": str(EXAMPLES / "images"),
                "metrics": {"clipscore": {"model": "org/not-cached"}}}
    # our tasks alone: indexing lm-eval's own takes 6 s
    only_ours = TaskManager(include_path=str(tasks_dir()), include_defaults=False, metadata=metadata)

    class Captioner(LM):
        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            generated.extend(requests)
            return ["a caption"] * len(requests)

    with pytest.raises(RequirementError, match="clipscore: option model: 'org/not-cached'"):
        lm_eval.simple_evaluate(model=Captioner(), tasks=["capeval_caption"], task_manager=only_ours)
    assert not generated

    proc = subprocess.run([str(Path(PYTHON).parent / "capeval-lm-eval"), "--model", "dummy", "--tasks",
                           "capeval_caption", "--metadata", json.dumps(metadata)], capture_output=True, text=True,
                          timeout=HANG_GUARD)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("capeval-lm-eval: error: clipscore: option model: 'org/not-cached'")
    assert "Traceback" not in proc.stderr


def test_a_gpu_placement_on_a_cpu_only_machine_is_one_line_before_loading(tiny_clip, monkeypatch):
    """docs/models.md's multi-GPU example (device_map=auto, max_memory naming GPU 0) on a machine without that
    GPU: one line naming it, exit 2, nothing loaded."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = score("-m", "clipscore", "--model", tiny_clip, "-o", "device_map=auto", "-o",
                 'max_memory={"0": "70GiB", "cpu": "200GiB"}')
    line = one_line(proc)
    assert line.startswith("capeval: error: clipscore: option max_memory names GPU 0, but this machine has no "
                           "CUDA GPU"), line
    assert "device_map='auto' alone" in line and "Loading weights" not in proc.stderr
