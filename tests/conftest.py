"""Shared fixtures: tiny random checkpoints (built once per session) and small image sets.

Scores from these models are meaningless; tests check properties that hold for any weights."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# The data folder beside the clone (a stranger has none: the tests that need it skip, see README.md);
# CAPEVAL_BENCHDATA points a checkout elsewhere (a git worktree) at it, or hides it (a folder that does not exist).
BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", ROOT.parent / "shared" / "benchdata"))

# A process a test starts is given up after this long: only a hang reaches it, however busy the machine (make
# test-under-load runs the suite beside 8 busy processes on 2 cores). No test asserts how long anything takes.
HANG_GUARD = float(os.environ.get("CAPEVAL_TEST_HANG_GUARD", 3600))
# The same for the Java tools (PTB tokenizer, METEOR, SPICE), whose silence the package ends after 120 s: in the
# suite (and every process it starts) only a hang reaches the limit. Tests of the limit set it themselves.
os.environ.setdefault("CAPEVAL_JAVA_TIMEOUT", str(int(HANG_GUARD)))

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
from suite_rules import pytest_collection_modifyitems, pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401
from file_server import FileServer  # noqa: E402

try:  # Hypothesis: no wall-clock checks (tests/helpers/suite_rules.py)
    from hypothesis import HealthCheck
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("capeval", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    _hypothesis_settings.load_profile("capeval")
except ImportError:
    pass


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_clip(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("clip", root=tiny_root))


def random_image(seed: int, size=(48, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture
def images() -> list[Image.Image]:
    return [random_image(i, size=(40 + 8 * i, 36 + 4 * i)) for i in range(4)]


CAPTIONS = [
    "A dog runs on the grass.",
    "Two children play in the park!",
    "A red car next to a building",
    "An old man sits on a bench under a tree.",
]
REFERENCES = [
    ["A dog running on grass.", "A brown dog plays outside."],
    ["Kids playing in a park."],
    ["A car parked by a building.", "A red car.", "A vehicle on a street."],
    ["A man sitting on a bench.", "An elderly man rests under a tree."],
]


def write_corpus(root: Path, n: int = 40) -> tuple[Path, Path, list[dict]]:
    """``n`` captions over ``n // 2`` PNG files (two captions each, references for the text metrics) and a
    caption file naming them: the run-folder tests' corpus."""
    folder = root / "images"
    folder.mkdir()
    for k in range(n // 2):
        random_image(k, size=(30, 28)).save(folder / f"{k:02d}.png")
    rows = [{"image": f"{i // 2:02d}.png", "caption": f"{CAPTIONS[i % 4]} ({i})",
             "references": [f"{r} ({i // 2})" for r in REFERENCES[i % 4]]} for i in range(n)]
    captions = root / "captions.jsonl"
    captions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return captions, folder, rows


class StopAfter:
    """A ``should_stop`` that says stop on its ``n``-th call (an interruption at a chosen batch)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def __call__(self) -> bool:
        self.seen += 1
        return self.seen >= self.n


def run(cmd: list[str], env: dict | None = None, timeout: float = HANG_GUARD,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}")
    return proc


def cli(args: list, capsys) -> tuple[int, str, str]:
    """``capeval ARGS`` in this process: (exit code, stdout, stderr)."""
    from capeval_plugins.cli import main

    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> bool:
    """Whether stderr is the promised single ``capeval: error:`` line."""
    return err.count("\n") == 1 and err.startswith("capeval: error: ")


def capeval_in_process(args: list, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``capeval ARGS`` through :func:`capeval_plugins.cli.main` in this process, as a finished process would
    report it (exit code, stdout, stderr; argparse's own exits included): the same ``main`` the console script
    calls, without a new interpreter's 2-4 s of imports. What only a process shows (signals, torchrun, a killed
    run, the console script itself) stays with :func:`run`."""
    import contextlib
    import io

    from capeval_plugins.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exit:  # argparse's own usage errors
                code = exit.code
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["capeval", *map(str, args)], code, out.getvalue(), err.getvalue())


def capeval_here(args: list, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """:func:`capeval_in_process`, checked as :func:`run` checks the installed command: an AssertionError with
    its output unless it exits 0."""
    proc = capeval_in_process(args, cwd)
    if proc.returncode != 0:
        raise AssertionError(f"capeval {args} failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-4000:]}")
    return proc


class Interrupted(Exception):
    """Raised from a training callback to cut a run short (resume tests)."""


def interrupt_at(step: int):
    """A step callback that interrupts a training run when it reaches ``step``."""

    def stop(done: int) -> None:
        if done == step:
            raise Interrupted

    return stop


def free_port() -> int:
    """A free TCP port on localhost (DDP rendezvous in tests)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What every rank of a DDP test imports: the fork server imports it once, each rank then starts without it
RANK_IMPORTS = ["torch", "torch.distributed", "transformers.modeling_utils", "capeval_plugins.torchmetrics"]


def spawn_ranks(worker, args: tuple, nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn(worker, args, nprocs)`` with ranks forked from a fork server instead of
    started as new interpreters: the server (a fresh interpreter, started on the first call with this
    process's environment, holding none of its state) imports :data:`RANK_IMPORTS` once, so a rank no longer
    spends about 6 s of CPU on them (two per test, before)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_IMPORTS)
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def has_java() -> bool:
    return shutil.which("java") is not None


@pytest.fixture(scope="session")
def coco_meteor():
    """pycocoevalcap's own METEOR, with the full paraphrase table (its JVM takes seconds to start: one per
    session), stopped afterwards."""
    if not has_java():
        pytest.skip("METEOR needs Java")
    from pycocoevalcap.meteor.meteor import Meteor

    meteor = Meteor()
    yield meteor
    meteor.__del__()


PYTHON = sys.executable


def torchvision_works() -> bool:
    """torchvision imports and its operators register (Qwen-VL processors need it; on some machines no
    torchvision wheel matches the installed torch, and then importing it fails)."""
    import importlib

    try:
        importlib.import_module("torchvision.transforms.v2.functional")
    except Exception:  # ImportError, or RuntimeError from operators that fail to register
        return False
    return True


needs_torchvision = pytest.mark.skipif(not torchvision_works(), reason="Qwen-VL processors need torchvision "
                                       "(pip install -e '.[qwen]')")


# Real captions and photos for side-by-side tests against peer packages (BENCHDATA, above).
FLICKR8K_EXPERT = BENCHDATA / "flickr8k_expert" / "flickr8k.json"


def flickr8k_pairs(n_images: int):
    """The distinct (image, caption) pairs of the first ``n_images`` Flickr8k-Expert images with their image's
    references (:func:`capeval_plugins.testing.realistic.flickr8k_expert_pairs`); skips without the data."""
    if not FLICKR8K_EXPERT.is_file():
        pytest.skip(f"Flickr8k-Expert is not at {FLICKR8K_EXPERT} (set CAPEVAL_BENCHDATA)")
    from capeval_plugins.testing.realistic import flickr8k_expert_pairs

    return flickr8k_expert_pairs(FLICKR8K_EXPERT, n_images)


def flickr8k_rows(n_images: int, long_side: int = 255):
    """:func:`flickr8k_pairs` and one image per row: a crop of a real photo per Flickr image, the same object
    for that image's rows. ``long_side`` 255 px keeps the shorter side under 256, below which the runner does
    not reduce images for the tiny CLIP's 32 px processor, so a peer resizing the photo itself sees the same
    pixels. Skips without the data or scikit-image."""
    pairs = flickr8k_pairs(n_images)
    pytest.importorskip("skimage")
    from capeval_plugins.testing.realistic import photo_crops

    crops = photo_crops(pairs.n_images, long_side=long_side)
    return pairs, [crops[k] for k in pairs.image]


def large_photos(folder: Path) -> list[Path]:
    """Real photographs larger than 4x a tiny CLIP's 32 px side, several of odd aspect ratios, as JPEG files:
    Grace Hopper at 4000x2667 (12 megapixels; its width does not divide evenly into a processor's resize) and
    a 4000x700 strip of it, scikit-image's coffee (600x400) and rocket (427x640, portrait; its file carries an
    EXIF orientation tag, 6 = rotate 90 degrees to view, which no entry point applies: the pixels as stored are
    what Image.open and the papers' code read), and a 263x1201 strip of the motorcycle pair. Needs scikit-image
    and matplotlib."""
    from capeval_plugins.testing.realistic import photo

    hopper = photo("grace_hopper").resize((4000, 2667), Image.LANCZOS)
    motorcycle = photo("motorcycle_left")
    images = {"hopper_12mp": hopper, "hopper_strip": hopper.crop((0, 900, 4000, 1600)),
              "coffee": photo("coffee"), "rocket": photo("rocket"),
              "motorcycle_strip": motorcycle.crop((200, 0, 463, 500)).resize((263, 1201), Image.BICUBIC)}
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, img in images.items():
        paths.append(folder / f"{name}.jpg")
        exif = Image.Exif()
        if name == "rocket":
            exif[0x0112] = 6  # Orientation
        img.save(paths[-1], quality=95, exif=exif.tobytes())
    return paths


LARGE_PHOTO_CAPTIONS = ["a portrait of a woman in a naval uniform", "a strip of a portrait",
                        "a cup of coffee on a saucer", "a rocket standing on its launch pad",
                        "a motorcycle parked in a room"]


def reference_clip_cosines(model: str, images: list, captions: list[str],
                           prefix: str = "A photo depicts ", official: bool = True) -> np.ndarray:
    """CLIPScore's cosine computed without capeval's pipeline, one forward pass per image and per text, each image
    exactly as given (a path is opened and converted to RGB, nothing else). ``official``: fed as the official
    code feeds OpenAI's CLIP (clip.load's transform, written out in capeval_plugins.testing.official_code, and
    clip.tokenize's cleaning), CLIPScore's default; else the model's own processor and tokenizer."""
    import torch
    from transformers import CLIPModel, CLIPProcessor

    from capeval_plugins.models.encoders.openai_clip import clean_text
    from capeval_plugins.testing.official_code import torchvision_transform

    clip, processor = CLIPModel.from_pretrained(model).eval(), CLIPProcessor.from_pretrained(model)
    crop = processor.image_processor.crop_size["height"]
    transform = torchvision_transform(crop, processor.image_processor.image_mean, processor.image_processor.image_std)
    out = []
    with torch.inference_mode():
        for image, caption in zip(images, captions):
            if not isinstance(image, Image.Image):
                with Image.open(image) as opened:
                    image = opened.convert("RGB")
            if official:
                pixels, text = transform(image)[None], clean_text(prefix + caption)
            else:
                pixels, text = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"], prefix + caption
            image_feats = clip.get_image_features(pixel_values=pixels)
            text_feats = clip.get_text_features(**processor.tokenizer([text], return_tensors="pt"))
            image_feats, text_feats = (getattr(f, "pooler_output", f) for f in (image_feats, text_feats))
            out.append(float(torch.nn.functional.cosine_similarity(image_feats, text_feats)[0]))
    return np.asarray(out)


@pytest.fixture(scope="session", autouse=True)
def private_key_folder(tmp_path_factory):
    """The user's secret (capeval_plugins.files.secret) in a folder of the session, not the real ~/.config;
    subprocesses inherit it."""
    folder = tmp_path_factory.mktemp("capeval-config")
    os.environ["CAPEVAL_CONFIG_DIR"] = str(folder / "capeval_plugins")
    yield folder


@pytest.fixture(scope="session", autouse=True)
def private_cache_folder(tmp_path_factory):
    """The package's caches (METEOR's paraphrase index: built once per session, on first use) in a folder of
    the session, not the real ~/.cache; subprocesses inherit it."""
    folder = tmp_path_factory.mktemp("capeval-cache")
    os.environ["CAPEVAL_CACHE"] = str(folder)
    yield folder


@pytest.fixture
def no_order_probe(monkeypatch):
    """Off: the session's row-order probe (session.mapping.check_row_order maps a few samples of a metric's first batch
    in two orders), for tests that count a metric's calls."""
    from capeval_plugins.session import mapping

    monkeypatch.setattr(mapping, "check_row_order", lambda *args: None)


def third_party_metrics() -> list[str]:
    """The registered metrics that come from a plugin installed beside the package, not from the package."""
    from capeval_plugins import registry

    return sorted(name for name, entry in registry.metrics().items() if entry.plugin != registry.BUILTIN)


def declared_recipe(name: str) -> dict:
    """The tiny recipe a third-party metric declares (``Metric.tiny_recipe``) for the suite's per-metric tests;
    without one the test is skipped, saying why: the suite tests the package's own metrics on its own recipes and
    an installed plugin's only on the recipe the plugin gives (docs/adding-a-metric.md)."""
    from capeval_plugins import registry

    entry = registry.get(name)
    recipe = entry.cls.tiny_recipe()
    if recipe is None:
        pytest.skip(f"{name} comes from the installed plugin {entry.distribution or entry.plugin!r}, which declares no "
                    "tiny recipe (Metric.tiny_recipe, docs/adding-a-metric.md): its per-metric tests are not run here")
    return dict(recipe)


# A local HTTP server on 127.0.0.1 and downloads switched on: what talks to a hub or a release host is tested
# through the real client against it (tests/test_fetch_weights.py, test_download_regressions.py).

@pytest.fixture
def server():
    with FileServer() as running:
        yield running


@pytest.fixture
def online(monkeypatch, tmp_path):
    """Downloads on in this process (the suite runs with HF_HUB_OFFLINE=1), the package's cache in tmp_path."""
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "5")
    return tmp_path / "cache"


def words_metric():
    """A toy pointwise metric (words per caption, characters as an extra; no model), defined on first use so that
    conftest imports no capeval module: the tests of composites and of bench's extras."""
    import torch

    from capeval_plugins.contract import MetricInfo, PointwiseMetric

    class Words(PointwiseMetric):
        info = MetricInfo(name="words", display_name="Words", description="", citation="", references="never",
                          images="never")
        extra_names = ("chars",)

        def score(self, batch):
            return {"score": torch.tensor([float(len(c.split())) for c in batch.candidates], dtype=torch.float64),
                    "chars": torch.tensor([float(len(c)) for c in batch.candidates], dtype=torch.float64)}

    return Words


@pytest.fixture
def clip_copy(tiny_clip, tmp_path):
    """A copy of the tiny CLIP to damage or rewrite (the shared one stays whole), the process's models dropped
    before and after."""
    import shutil

    from capeval_plugins.resources.loading import clear_cache

    clear_cache()
    copy = tmp_path / "clip"
    shutil.copytree(tiny_clip, copy)
    yield copy
    clear_cache()
