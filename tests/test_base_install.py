"""The README's commands on a base install (``pip install capeval-plugins``, no extras).

The suite's venv holds every extra, so a command that imports an optional package passes here and fails for a
user. These tests run the commands in a second venv that holds only what a base install has: the closure of
capeval-plugins' own requirements (no extras), linked file by file from the suite's venv (same versions,
built in seconds). A command meant for a base install must run; one that needs an extra must say which in one
line (exit 2), before any work.
"""
from __future__ import annotations

import functools
import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "capeval-plugins"


def base_closure() -> set[str]:
    """The distributions a base install of the project pulls in (requirements without extras, recursively,
    markers evaluated), canonical names."""
    seen, todo = set(), [(PROJECT, frozenset())]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return {key for key, _ in seen}


def base_venv(folder: Path) -> Path:
    """A venv holding exactly the base closure: each of its distributions' files (modules, metadata, .pth
    files), linked from this environment's site-packages. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = Path(next((folder / "lib").glob("python*")) / "site-packages")
    for dist in md.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in base_closure_cached():
            continue
        for file in dist.files or []:
            if file.parts[0] == "..":  # console scripts: the tests run `python -m`
                continue
            source, target = Path(dist.locate_file(file)), site / file
            if source.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(source)
    return folder / "bin" / "python"


@functools.lru_cache(maxsize=1)
def base_closure_cached() -> frozenset[str]:
    return frozenset(base_closure())


@pytest.fixture(scope="module")
def base_python(tmp_path_factory) -> str:
    return str(base_venv(tmp_path_factory.mktemp("base-install") / "venv"))


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
ENV.pop("PYTHONPATH", None)


def run(python: str, args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def assert_names_the_extra(proc: subprocess.CompletedProcess, extra: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and f"'.[{extra}]'" in lines[0], proc.stderr


def test_the_blocker_hides_the_extras_and_keeps_the_base(base_python, tmp_path):
    probe = ("import importlib.util as u, json; names = ['torch', 'transformers', 'evaluate', 'lm_eval', "
             "'pycocoevalcap', 'torchmetrics', 'pluggy', 'PIL', 'skimage', 'accelerate', 'peft', 'diffusers', "
             "'lightning', 'scipy', 'pytest']\n"
             "def ok(n):\n  try:\n    __import__(n); return True\n  except ModuleNotFoundError:\n    return False\n"
             "print(json.dumps({n: ok(n) for n in names}))")
    proc = run(base_python, ["-c", probe], tmp_path)
    found = json.loads(proc.stdout)
    assert all(found[n] for n in ("torch", "transformers", "evaluate", "lm_eval", "pycocoevalcap",
                                  "torchmetrics", "pluggy", "PIL")), found
    assert not any(found[n] for n in ("skimage", "accelerate", "peft", "diffusers", "lightning", "pytest")), found


def test_sample_photos_name_their_extra_before_writing_anything(base_python, tmp_path):
    proc = run(base_python, ["-m", "capeval_plugins.testing.realistic", "photos"], tmp_path)
    assert_names_the_extra(proc, "photos")
    assert not (tmp_path / "photos").exists()


def test_lm_eval_wrapper_names_accelerate_before_loading_anything(base_python, tmp_path):
    cli = "import sys; from capeval_plugins.adapters.lm_eval import main; main(sys.argv[1:])"  # capeval-lm-eval
    proc = run(base_python, ["-c", cli, "--model", "hf-multimodal", "--model_args",
                             "pretrained=llava-hf/llava-interleave-qwen-0.5b-hf", "--tasks", "capeval_caption"],
               tmp_path, timeout=120)
    assert_names_the_extra(proc, "accelerate")


def test_lm_eval_wrapper_help_prints_on_a_base_install(base_python, tmp_path):
    """``capeval-lm-eval --help`` prints help and exits 0 without accelerate (lm-eval's default --model hf needs it:
    only a run is refused for it, not the help)."""
    cli = "import sys; from capeval_plugins.adapters.lm_eval_cli import main; main(sys.argv[1:])"  # capeval-lm-eval
    proc = run(base_python, ["-c", cli, "--help"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "capeval metric" in proc.stdout and "usage" in proc.stdout.lower()


def test_readme_commands_and_examples_run_on_a_base_install(base_python, tmp_path, tiny_clip):
    """make demo's scoring command and the README's Python examples of every ecosystem, on the tiny CLIP."""
    from capeval_plugins.testing.realistic import write_photos

    write_photos(tmp_path / "photos")
    demo = ["-m", "capeval_plugins.cli", "score", "-m", "clipscore", "-m", "refclipscore", "-m", "msd_score",
            "-m", "soft_msd", "--model", tiny_clip, "--images", "photos", "--captions",
            str(ROOT / "examples" / "photos.jsonl"), "--out", "scores.parquet"]
    proc = run(base_python, demo, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "scores.parquet").stat().st_size > 0
    script = textwrap.dedent(f"""
        import evaluate, json
        images, captions, refs = ["photos/camera.jpg"], ["A man with a camera."], [["a photographer"]]
        out = {{"evaluate": evaluate.load("clipscore", model={tiny_clip!r}).compute(
            images=images, predictions=captions, references=refs)["clipscore"]}}
        from capeval_plugins.torchmetrics import CLIPScore
        metric = CLIPScore(model={tiny_clip!r})
        metric.update(images, captions, refs, ids=[0])
        out["torchmetrics"] = float(metric.compute())
        from capeval_plugins.pycocoevalcap import ClipScore, ImageResolver
        out["pycocoevalcap"] = ClipScore(ImageResolver("photos/", pattern="{{id}}"), model={tiny_clip!r}).compute_score(
            {{"camera.jpg": refs[0]}}, {{"camera.jpg": captions}})[0]
        import capeval_plugins
        out["load"] = capeval_plugins.load("clipscore", model={tiny_clip!r})(images, captions, refs).score
        print(json.dumps(out))
    """)
    proc = run(base_python, ["-c", script], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(isinstance(v, float) and 0 <= v <= 2.5 for v in scores.values()), scores
