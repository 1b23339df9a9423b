"""The README's commands on a base install (``pip install capeval-plugins``, no extras), and on an install with
one ecosystem's extra.

The suite's venv holds every extra, so a command that imports an optional package passes here and fails for a
user. These tests run the commands in venvs that hold only what such an install has: the closure of
capeval-plugins' own requirements (with the extras named), linked file by file from the suite's venv (same
versions, built in seconds). A command meant for a base install must run; one that needs an extra must say which
in one line (exit 2 on a command line, one ``MissingExtra`` line from Python), before any work.
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
from conftest import HANG_GUARD, ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "capeval-plugins"


def closure(extras: tuple[str, ...] = ()) -> set[str]:
    """The distributions an install of the project with ``extras`` pulls in (requirements, recursively, markers
    evaluated), canonical names."""
    seen, todo = set(), [(PROJECT, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if (key, wanted) in seen:
            continue
        seen.add((key, wanted))
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return {key for key, _ in seen}


def linked_venv(folder: Path, extras: tuple[str, ...] = ()) -> Path:
    """A venv holding exactly the closure of ``extras``: each of its distributions' files (modules, metadata,
    .pth files), linked from this environment's site-packages. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = Path(next((folder / "lib").glob("python*")) / "site-packages")
    wanted = closure_cached(extras)
    for dist in md.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in wanted:
            continue
        for file in dist.files or []:
            if file.parts[0] == "..":  # console scripts: the tests run `python -m`
                continue
            source, target = Path(dist.locate_file(file)), site / file
            for src, dst in ((source, target), *_bytecode(source, target)):
                if src.is_file() and not dst.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.symlink_to(src)
    return folder / "bin" / "python"


def _bytecode(source: Path, target: Path) -> list[tuple[Path, Path]]:
    """A module's compiled bytecode beside it, where an import has written it (it is in no RECORD): a process
    here then need not compile torch anew (nor, under PYTHONDONTWRITEBYTECODE, every process)."""
    if source.suffix != ".py":
        return []
    name = f"{source.stem}.{sys.implementation.cache_tag}.pyc"
    return [(source.parent / "__pycache__" / name, target.parent / "__pycache__" / name)]


@functools.lru_cache(maxsize=None)
def closure_cached(extras: tuple[str, ...]) -> frozenset[str]:
    return frozenset(closure(extras))


@pytest.fixture(scope="module")
def base_python(tmp_path_factory) -> str:
    return str(linked_venv(tmp_path_factory.mktemp("base-install") / "venv"))


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
ENV.pop("PYTHONPATH", None)


def run(python: str, args: list[str], cwd: Path, timeout: float = HANG_GUARD) -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def assert_names_the_extra(proc: subprocess.CompletedProcess, extra: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and f"'.[{extra}]'" in lines[0], proc.stderr


def test_the_base_holds_no_ecosystem():
    base = closure_cached(())
    assert {"torch", "transformers", "pluggy", "pillow", "numpy", "xxhash"} <= base
    assert not base & {"evaluate", "datasets", "lm-eval", "pycocoevalcap", "torchmetrics", "lightning", "pandas",
                       "pyarrow", "scipy", "scikit-learn", "scikit-image", "accelerate", "peft", "diffusers"}, base


def test_sample_photos_name_their_extra_before_writing_anything(base_python, tmp_path):
    proc = run(base_python, ["-m", "capeval_plugins.testing.realistic", "photos"], tmp_path)
    assert_names_the_extra(proc, "photos")
    assert not (tmp_path / "photos").exists()


ECOSYSTEM_CHECKS = textwrap.dedent("""
    import contextlib, importlib, io, json, sys
    from capeval_plugins.core.messages import MissingExtra

    def command(main, args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exit:
                code = exit.code
        return {"returncode": code or 0, "stdout": out.getvalue(), "stderr": err.getvalue()}

    said = {}
    for module in ("capeval_plugins.torchmetrics", "capeval_plugins.pycocoevalcap", "capeval_plugins.lm_eval",
                   "capeval_plugins.adapters.hf_evaluate", "capeval_plugins.adapters.lmms_eval"):
        try:
            importlib.import_module(module)
        except MissingExtra as err:
            said[module] = str(err)
    from capeval_plugins.adapters.lm_eval_cli import main as lm_eval_cli  # capeval-lm-eval
    from capeval_plugins.cli import main as capeval
    cider = ["score", "-m", "cider", "--captions", sys.argv[1], "--quiet"]
    print(json.dumps({"imports": said, "tasks": command(lm_eval_cli, ["--tasks", "capeval_caption"]),
                      "help": command(lm_eval_cli, ["--help"]), "cider": command(capeval, cider),
                      "untokenised": command(capeval, [*cider, "-o", "cider.tokenize=false"])}))
""")


def test_every_ecosystem_says_which_extra_in_one_line(base_python, tmp_path):
    """Each adapter imported without its ecosystem: one MissingExtra line naming the extra; the lm-eval wrapper
    and a classic metric that needs pycocoevalcap's jars: one line, exit 2, before any work (help prints). One
    interpreter runs them all (the commands through their ``main``, as the console scripts call it)."""
    captions = tmp_path / "c.jsonl"
    captions.write_text(json.dumps({"caption": "a dog", "references": ["a dog runs"]}) + "\n")
    proc = run(base_python, ["-c", ECOSYSTEM_CHECKS, str(captions)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for module, extra in (("capeval_plugins.torchmetrics", "torchmetrics"), ("capeval_plugins.lm_eval", "lm-eval"),
                          ("capeval_plugins.pycocoevalcap", "pycocoevalcap"), ("capeval_plugins.adapters.lmms_eval", "lmms"),
                          ("capeval_plugins.adapters.hf_evaluate", "evaluate")):
        assert f"'.[{extra}]'" in got["imports"].get(module, ""), (module, got["imports"])
    tasks, helped, cider, untokenised = (subprocess.CompletedProcess([], **got[k])
                                         for k in ("tasks", "help", "cider", "untokenised"))
    assert_names_the_extra(tasks, "lm-eval")
    # --help prints, exit 0, without lm-eval (nor accelerate, which lm-eval's default --model hf needs)
    assert helped.returncode == 0 and "'.[lm-eval]'" in helped.stdout, helped
    assert "capeval metric" in helped.stdout and "usage" in helped.stdout.lower()
    assert_names_the_extra(cider, "pycocoevalcap")
    assert untokenised.returncode == 0, untokenised.stderr[-3000:]  # no jar needed: runs on the base


def test_the_demo_and_the_python_api_run_on_a_base_install(base_python, tmp_path, tiny_clip):
    """make demo's scoring command and the README's plain Python example, on the tiny CLIP."""
    from capeval_plugins.testing.realistic import write_photos

    write_photos(tmp_path / "photos")
    demo = ["score", "-m", "clipscore", "-m", "refclipscore", "-m", "msd_score", "-m", "soft_msd", "--model", tiny_clip,
            "--images", "photos", "--captions", str(ROOT / "examples" / "photos.jsonl"), "--out", "scores.jsonl",
            "--quiet"]
    script = (f"from capeval_plugins.cli import main; code = main({demo!r}); assert code == 0, code\n"  # one interpreter
              f"import capeval_plugins; print(capeval_plugins.load('clipscore', model={tiny_clip!r})("
              "['photos/camera.jpg'], ['A man with a camera.'], [['a photographer']]).score)")
    proc = run(base_python, ["-c", script], tmp_path)
    assert proc.returncode == 0 and 0 <= float(proc.stdout.strip().splitlines()[-1]) <= 2.5, proc.stderr[-3000:]
    assert len((tmp_path / "scores.jsonl").read_text().splitlines()) == 14


@pytest.mark.parametrize("extra", ["evaluate", "torchmetrics", "pycocoevalcap"])
def test_each_ecosystem_works_with_its_own_extra_alone(extra, tmp_path_factory, tiny_clip):
    """evaluate.load("clipscore") wherever evaluate is installed (no import of ours); the torchmetrics class
    without evaluate; the pycocoevalcap scorer without torchmetrics."""
    python = str(linked_venv(tmp_path_factory.mktemp(f"with-{extra}") / "venv", (extra,)))
    from capeval_plugins.testing.realistic import write_photos

    folder = tmp_path_factory.mktemp(f"photos-{extra}")
    write_photos(folder / "photos")
    call = {
        "evaluate": f"import evaluate; print(evaluate.load('clipscore', model={tiny_clip!r}).compute(images=IMAGES, "
                    "predictions=CAPTIONS)['clipscore'])",
        "torchmetrics": f"from capeval_plugins.torchmetrics import CLIPScore; m = CLIPScore(model={tiny_clip!r}); "
                        "m.update(IMAGES, CAPTIONS, ids=[0]); print(float(m.compute()))",
        "pycocoevalcap": "from capeval_plugins.pycocoevalcap import ClipScore, ImageResolver; "
                         f"print(ClipScore(ImageResolver('photos/', pattern='{{id}}'), model={tiny_clip!r})"
                         ".compute_score({'camera.jpg': ['a photographer']}, {'camera.jpg': CAPTIONS})[0])",
    }[extra]
    script = f"IMAGES, CAPTIONS = ['photos/camera.jpg'], ['A man with a camera.']\n{call}"
    proc = run(python, ["-c", script], folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 0 <= float(proc.stdout.strip().splitlines()[-1]) <= 2.5


def test_lm_eval_wrapper_names_accelerate_before_loading_anything(tmp_path_factory, tmp_path):
    """With the lm-eval extra but not lm-eval's own `hf` extra: the model backend's missing accelerate, in one line."""
    python = str(linked_venv(tmp_path_factory.mktemp("with-lm-eval") / "venv", ("lm-eval",)))
    cli = "import sys; from capeval_plugins.adapters.lm_eval_cli import main; main(sys.argv[1:])"  # capeval-lm-eval
    proc = run(python, ["-c", cli, "--model", "hf-multimodal", "--model_args",
                        "pretrained=llava-hf/llava-interleave-qwen-0.5b-hf", "--tasks", "capeval_caption"],
               tmp_path, timeout=HANG_GUARD)
    assert_names_the_extra(proc, "accelerate")
