"""Every shell and Python example of the README, docs/ and the metric cards runs as written, on tiny checkpoints
(a card's ``>>>`` examples as doctests: each printed output must match).

Each ```bash / ```python block is executed in a sandbox folder that holds the files the examples name
(`examples/`, `captions.jsonl`, `images/`, `dog.jpg`, a COCO annotation file, ...), with the model ids
replaced by tiny local checkpoints. The blocks of one page share one Python namespace (as a reader runs them
one after the other), seeded with the variables the prose defines (`images`, `candidates`, `references`,
features of the documented shapes). A block that cannot run here (a 72B model, a benchmark's data, a
download, a hub model no tiny checkpoint stands in for) is listed in NOT_RUN with the reason and shows as skipped; a listed block that no longer exists
fails, so the list stays true. A new block runs by default: the next drift between docs and code is caught.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, HANG_GUARD, ROOT, has_java, random_image

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")),
         *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "metric_cards").glob("*/README.md"))]
RUNNABLE = ("bash", "python")

# (page, text the block contains) -> why it is not run here.
NOT_RUN = {
    ("README.md", "make demo"): "the set-up commands themselves (CI runs `make test`; tests/test_docs.py checks them)",
    ("README.md", "capeval-lm-eval --model hf-multimodal"): "lm-eval with a real LVLM (the task runs in "
                                                              "tests/test_lm_eval_adapter.py)",
    ("docs/ecosystems/lm-eval.md", "capeval-lm-eval --model hf-multimodal"): "lm-eval with a real LVLM",
    ("docs/ecosystems/lm-eval.md", '--metadata \'{"captions": "..."'): "a fragment of the command above",
    ("README.md", "capeval bench flickr8k-expert"): "a benchmark's annotation file (tests/test_bench_*.py)",
    ("docs/bench.md", "capeval bench <benchmark>"): "the command's synopsis",
    ("docs/bench.md", "capeval reproduce [--metric NAME ...]"): "the command's synopsis",
    ("docs/bench.md", "capeval bench flickr8k-expert"): "benchmarks' annotation files (tests/test_bench_*.py)",
    ("docs/bench.md", "run_benchmark("): "a benchmark's annotation file (tests/test_bench_runner.py)",
    ("docs/bench.md", "capeval verify expert.json"): "a benchmark's report (tests/test_verify.py checks reports)",
    ("docs/ecosystems/cli.md", "capeval list [--json]"): "the commands' synopsis",
    ("docs/ecosystems/cli.md", "capeval convert vilbert"): "the released 12-in-1 checkpoint (tests/test_vilbert.py)",
    ("docs/ecosystems/cli.md", "capeval fetch-weights polos"): "downloads a release from its authors' server "
                                                              "(tests/test_fetch_weights.py: a loopback server)",
    ("docs/models.md", "capeval fetch-weights pacscore"): "downloads releases from their authors' servers "
                                                         "(tests/test_fetch_weights.py: a loopback server)",
    ("docs/vilbert.md", "capeval convert vilbert"): "the released 12-in-1 checkpoint (tests/test_vilbert.py)",
    ("docs/vilbert.md", "script/extract_features.py"): "another project's feature extractor",
    ("docs/vilbert.md", 'model="vilbert-12in1"'): "the converted 12-in-1 checkpoint and its region features",
    ("docs/ecosystems/cli.md", "torchrun --nproc_per_node"): "several processes (DDP is tested in tests/test_cli.py)",
    ("docs/index.md", "pip install"): "installs the package",
    ("docs/models.md", "pip install -e '.[accelerate]'\n"): "installs an extra",
    ("docs/models.md", "pip install -e '.[accelerate]'\ncapeval"): "installs an extra, then a 72B judge",
    ("docs/models.md", "pip install -e '.[qwen]'"): "installs an extra",
    ("docs/models.md", "max_memory='{"): "DISCODE's 72B judge over several GPUs (tests/test_device_map.py)",
    ("docs/models.md", 'device_map="auto", batch_size=16'): "DISCODE's 72B judge over several GPUs",
    ("docs/training.md", "capeval train rigel"): "human-judgment training data (tests/test_rigel_training.py)",
    ("docs/training.md", "train_phase1"): "human-judgment training data (tests/test_rigel_training.py)",
    ("docs/training.md", "capeval train msd-aligner"): "CC3M-595K (tests/test_msd_aligner.py)",
    ("docs/training.md", "train_aligner"): "CC3M-595K (tests/test_msd_aligner.py)",
    ("README.md", "lmms-eval --model llava_onevision"): "lmms-eval with a real LVLM (a task runs end to end in "
                                                       "tests/test_lmms_eval_adapter.py, in .venv-lmms)",
    ("docs/ecosystems/lmms-eval.md", "lmms-eval --model llava_onevision"): "lmms-eval with a real LVLM",
    ("docs/ecosystems/lmms-eval.md", "pip install -e"): "installs an extra",
    ("docs/testing.md", "venv-tf457"): "builds a venv with another transformers (an opt-in check, see the page)",
    ("docs/testing.md", "make test-under-load"): "the whole suite beside 8 busy processes (tests/test_suite_rules.py "
                                                 "checks what it runs)",
    ("docs/testing.md", "make lock"): "resolves both environments anew and runs the suite (tests/test_pins.py)",
    # the example plugin's files and commands: tests/test_metric_kit.py checks the page shows the files as they are,
    # installs the plugin with pip and runs its tests and the suite's per-metric tests with it installed
    ("docs/adding-a-metric.md", "class WordPrecisionConfig"): "a file of examples/plugin (tests/test_metric_kit.py)",
    ("docs/adding-a-metric.md", "def capeval_metrics"): "a file of examples/plugin (tests/test_metric_kit.py)",
    ("docs/adding-a-metric.md", "class TestWordPrecision"): "a file of examples/plugin (tests/test_metric_kit.py)",
    ("docs/adding-a-metric.md", "pip install -e examples/plugin"): "installs the example plugin",
    ("docs/adding-a-metric.md", 'evaluate.load("word_precision")'): "needs the example plugin installed",
    ("docs/adding-a-metric.md", "pytest examples/plugin/tests"): "needs the example plugin installed",
    # metric cards: what each needs that is not here (hub weights, released checkpoints, benchmark files)
    ("metric_cards/meteor/README.md", "capeval bench flickr8k-expert --data flickr8k.json --metric meteor"):
        "a benchmark's annotation file (FLEUR's annotations/flickr8k.json; tests/test_bench_*.py)",
    ("metric_cards/dino_cycle/README.md", 'dino = capeval_plugins.load("dino_cycle", generated_images="gen/")'):
        "DINO, a hub model, and a folder of generated images (tests/test_redemption.py)",
    ('metric_cards/bertscore/README.md', 'bertscore = evaluate.load("capeval/bertscore", model="micros'):
        'roberta-large / microsoft/deberta-v3-large, hub models (tests/test_bertscore*.py run these calls on tiny checkpoints)',
    ('metric_cards/bertscore/README.md', 'result = capeval_plugins.load("bertscore", idf=True)(None, c'):
        'roberta-large / microsoft/deberta-v3-large, hub models (tests/test_bertscore*.py run these calls on tiny checkpoints)',
    ('metric_cards/bertscore/README.md', 'capeval score --metric bertscore --captions captions.jsonl -'):
        'roberta-large / microsoft/deberta-v3-large, hub models (tests/test_bertscore*.py run these calls on tiny checkpoints)',
    ('metric_cards/bertscore/README.md', '>>> bertscore = evaluate.load("capeval/bertscore")'):
        'roberta-large / microsoft/deberta-v3-large, hub models (tests/test_bertscore*.py run these calls on tiny checkpoints)',
    ('metric_cards/bleu1/README.md', 'capeval bench flickr8k-expert --data flickr8k.json --metric '):
        "a benchmark's annotation file (FLEUR's annotations/flickr8k.json; tests/test_bench_*.py)",
    ('metric_cards/bleu2/README.md', 'capeval bench flickr8k-expert --data flickr8k.json --metric '):
        "a benchmark's annotation file (FLEUR's annotations/flickr8k.json; tests/test_bench_*.py)",
    ('metric_cards/bleu3/README.md', 'capeval bench flickr8k-expert --data flickr8k.json --metric '):
        "a benchmark's annotation file (FLEUR's annotations/flickr8k.json; tests/test_bench_*.py)",
    ('metric_cards/bleu4/README.md', 'capeval bench flickr8k-expert --data flickr8k.json --metric '):
        "a benchmark's annotation file (FLEUR's annotations/flickr8k.json; tests/test_bench_*.py)",
    ('metric_cards/cider/README.md', 'capeval bench pascal50s --data pascal_50s.json --metric cide'):
        "a benchmark's annotation file (FLEUR's annotations/pascal_50s.json; tests/test_bench_*.py)",
    ('metric_cards/clipscore/README.md', 'result = capeval_plugins.load("clipscore")(images, candidate'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/clipscore/README.md', 'capeval score --metric clipscore --images DIR --captions cap'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/clipscore/README.md', '>>> clip_s = evaluate.load("clipscore")'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/dino_cycle/README.md', 'dino = capeval_plugins.load("dino_cycle")                 # '):
        'Stable Diffusion 3 and DINO, hub models (tests/test_redemption.py runs DINO-cycle on tiny ones)',
    ('metric_cards/dino_cycle/README.md', 'capeval score --metric dino_cycle --images DIR --captions ca'):
        'Stable Diffusion 3 and DINO, hub models (tests/test_redemption.py runs DINO-cycle on tiny ones)',
    ('metric_cards/dino_cycle/README.md', '>>> out = capeval_plugins.load("dino_cycle", generated_image'):
        'Stable Diffusion 3 and DINO, hub models (tests/test_redemption.py runs DINO-cycle on tiny ones)',
    ('metric_cards/discode/README.md', 'discode = evaluate.load("discode", model="llava-hf/llava-nex'):
        "DISCODE's LVLM judge (llava-hf/llava-next-72b-hf), a hub model (tests/test_fleur_discode.py)",
    ('metric_cards/discode/README.md', 'result = capeval_plugins.load("discode", scale="0.0-1.0")(im'):
        "DISCODE's LVLM judge (llava-hf/llava-next-72b-hf), a hub model (tests/test_fleur_discode.py)",
    ('metric_cards/discode/README.md', 'capeval score --metric discode --images DIR --captions capti'):
        "DISCODE's LVLM judge (llava-hf/llava-next-72b-hf), a hub model (tests/test_fleur_discode.py)",
    ('metric_cards/discode/README.md', "pip install -e '.[accelerate]'"):
        'installs an extra',
    ('metric_cards/discode/README.md', '>>> discode = evaluate.load("discode")'):
        "DISCODE's LVLM judge (llava-hf/llava-next-72b-hf), a hub model (tests/test_fleur_discode.py)",
    ('metric_cards/fleur/README.md', 'fleur = evaluate.load("fleur", model="llava-hf/llava-1.5-13b'):
        "FLEUR's LVLM judge (llava-hf/llava-1.5-13b-hf), a hub model (tests/test_fleur_discode.py)",
    ('metric_cards/fleur/README.md', 'result = capeval_plugins.load("fleur")(images, candidates)  '):
        "FLEUR's LVLM judge (llava-hf/llava-1.5-13b-hf), a hub model (tests/test_fleur_discode.py)",
    ('metric_cards/fleur/README.md', 'capeval score --metric fleur --images DIR --captions caption'):
        "FLEUR's LVLM judge (llava-hf/llava-1.5-13b-hf), a hub model (tests/test_fleur_discode.py)",
    ('metric_cards/fleur/README.md', '>>> fleur = evaluate.load("fleur")'):
        "FLEUR's LVLM judge (llava-hf/llava-1.5-13b-hf), a hub model (tests/test_fleur_discode.py)",
    ('metric_cards/meteor/README.md', 'evaluate.load("capeval/meteor").compute(predictions=["A dog '):
        "a benchmark's annotation file (FLEUR's annotations/flickr8k.json; tests/test_bench_*.py)",
    ('metric_cards/mid/README.md', 'mid = capeval_plugins.load("mid")                       # op'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/mid/README.md', 'mid.fit_reference(images, references, save_to="coco_fit.npz"'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/mid/README.md', 'capeval score --metric mid --images DIR --captions captions.'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/msd_score/README.md', 'msd = evaluate.load("msd_score")                          # '):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/msd_score/README.md', 'result = capeval_plugins.load("msd_score", setting="long")(i'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/msd_score/README.md', 'capeval score --metric msd_score --images DIR --captions cap'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/msd_score/README.md', '>>> msd = capeval_plugins.load("msd_score", diagnostics=True'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/pacscore/README.md', 'capeval fetch-weights pacscore --sha256 HEX'):
        'the released PAC-S checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/pacscore/README.md', 'pacs = evaluate.load("pacscore")'):
        'the released PAC-S checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/pacscore/README.md', '>>> out = evaluate.load("pacscore").compute(images=[img], pr'):
        'the released PAC-S checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/pacscore_pp/README.md', 'capeval fetch-weights pacscore_pp --sha256 HEX'):
        'the released PAC-S++ checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/pacscore_pp/README.md', 'evaluate.load("pacscore_pp").compute(images=["dog.jpg"], pre'):
        'the released PAC-S++ checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/pacscore_pp/README.md', '>>> out = evaluate.load("pacscore_pp").compute(images=[img],'):
        'the released PAC-S++ checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/polos/README.md', 'capeval fetch-weights polos --sha256 HEX'):
        'the released Polos checkpoint converted by `capeval convert polos` (tests/test_pacscore_polos.py)',
    ('metric_cards/polos/README.md', 'evaluate.load("polos").compute(images=["dog.jpg"], predictio'):
        'the released Polos checkpoint converted by `capeval convert polos` (tests/test_pacscore_polos.py)',
    ('metric_cards/polos/README.md', '>>> out = evaluate.load("polos").compute(images=[img], predi'):
        'the released Polos checkpoint converted by `capeval convert polos` (tests/test_pacscore_polos.py)',
    ('metric_cards/redemption_score/README.md', 'from capeval_plugins.core.fusion import calibrate'):
        'Stable Diffusion 3, DINO, CLIP and DeBERTa-v3-large, hub models (tests/test_redemption.py)',
    ('metric_cards/redemption_score/README.md', 'capeval score --metric redemption_score --images DIR --capti'):
        'Stable Diffusion 3, DINO, CLIP and DeBERTa-v3-large, hub models (tests/test_redemption.py)',
    ('metric_cards/redemption_score/README.md', 'rs = capeval_plugins.load("redemption_score", cache_dir="/da'):
        'Stable Diffusion 3, DINO, CLIP and DeBERTa-v3-large, hub models (tests/test_redemption.py)',
    ('metric_cards/redemption_score/README.md', '>>> rs = capeval_plugins.load("redemption_score", generated_'):
        'Stable Diffusion 3, DINO, CLIP and DeBERTa-v3-large, hub models (tests/test_redemption.py)',
    ('metric_cards/refclipscore/README.md', '>>> out = evaluate.load("refclipscore").compute(images=[img]'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/refpacscore/README.md', 'refpacs = evaluate.load("refpacscore")    # after `capeval f'):
        'the released PAC-S checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/refpacscore/README.md', '>>> out = evaluate.load("refpacscore").compute(images=[img],'):
        'the released PAC-S checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/refpacscore_pp/README.md', 'evaluate.load("refpacscore_pp").compute(images=["dog.jpg"], '):
        'the released PAC-S++ checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/refpacscore_pp/README.md', '>>> out = evaluate.load("refpacscore_pp").compute(images=[im'):
        'the released PAC-S++ checkpoint converted by `capeval convert pacs` (tests/test_pacscore_polos.py)',
    ('metric_cards/rigel/README.md', 'capeval train rigel --phase 1 --train train.jsonl --val val.'):
        'a Rigel checkpoint trained on human judgments (tests/test_rigel*.py)',
    ('metric_cards/rigel/README.md', 'rigel = evaluate.load("rigel", checkpoint="rigel")          '):
        'a Rigel checkpoint trained on human judgments (tests/test_rigel*.py)',
    ('metric_cards/rigel/README.md', 'result = capeval_plugins.load("rigel", checkpoint="rigel")(i'):
        'a Rigel checkpoint trained on human judgments (tests/test_rigel*.py)',
    ('metric_cards/rigel/README.md', 'capeval score --metric rigel -o checkpoint=rigel --images DI'):
        'a Rigel checkpoint trained on human judgments (tests/test_rigel*.py)',
    ('metric_cards/rigel/README.md', '>>> rigel = evaluate.load("rigel", checkpoint="rigel")'):
        'a Rigel checkpoint trained on human judgments (tests/test_rigel*.py)',
    ('metric_cards/soft_msd/README.md', 'soft = evaluate.load("soft_msd")'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/soft_msd/README.md', 'result = capeval_plugins.load("soft_msd")(images, candidates'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/soft_msd/README.md', 'capeval score --metric soft_msd --images DIR --captions capt'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/soft_msd/README.md', '>>> soft = capeval_plugins.load("soft_msd")'):
        'the default CLIP of the metric (a hub model; tests run the same calls on a tiny CLIP)',
    ('metric_cards/spice/README.md', 'spice = capeval_plugins.load("spice")       # raises a clear'):
        "SPICE's Stanford CoreNLP jars, a download on first use (tests/test_coco_metrics.py)",
    ('metric_cards/vilbertscore/README.md', 'metric = capeval_plugins.load("vilbertscore", model="vilbert'):
        'the converted ViLBERT 12-in-1 checkpoint and its region features (tests/test_vilbert.py)',
    ('metric_cards/vilbertscore/README.md', 'vilbert = evaluate.load("vilbertscore", model="vilbert-12in1'):
        'the converted ViLBERT 12-in-1 checkpoint and its region features (tests/test_vilbert.py)',
    ('metric_cards/vilbertscore/README.md', 'from capeval_plugins.torchmetrics import ViLBERTScore       '):
        'the converted ViLBERT 12-in-1 checkpoint and its region features (tests/test_vilbert.py)',
    ('metric_cards/vilbertscore/README.md', 'capeval score --metric vilbertscore --model vilbert-12in1 -o'):
        'the converted ViLBERT 12-in-1 checkpoint and its region features (tests/test_vilbert.py)',
    ('metric_cards/vilbertscore/README.md', '>>> vilbert = evaluate.load("vilbertscore", model="vilbert-1'):
        'the converted ViLBERT 12-in-1 checkpoint and its region features (tests/test_vilbert.py)',
    ('metric_cards/expert/README.md', 'hf download hjkim811/EXPERT-llava-13b-lora'): "EXPERT's LoRA on LLaVA-1.5-13B (hjkim811/EXPERT-llava-13b-lora), a hub model (tests/test_expert.py runs these calls on a tiny LLaVA)",
    ('metric_cards/expert/README.md', 'expert = evaluate.load("expert")\nout = expert.compute'): "EXPERT's LoRA on LLaVA-1.5-13B (hjkim811/EXPERT-llava-13b-lora), a hub model (tests/test_expert.py runs these calls on a tiny LLaVA)",
    ('metric_cards/expert/README.md', 'result = capeval_plugins.load("expert")(images, candidates)'): "EXPERT's LoRA on LLaVA-1.5-13B (hjkim811/EXPERT-llava-13b-lora), a hub model (tests/test_expert.py runs these calls on a tiny LLaVA)",
    ('metric_cards/expert/README.md', 'capeval score --metric expert --images DIR'): "EXPERT's LoRA on LLaVA-1.5-13B (hjkim811/EXPERT-llava-13b-lora), a hub model (tests/test_expert.py runs these calls on a tiny LLaVA)",
    ('metric_cards/expert/README.md', '>>> expert = evaluate.load("expert")'): "EXPERT's LoRA on LLaVA-1.5-13B (hjkim811/EXPERT-llava-13b-lora), a hub model (tests/test_expert.py runs these calls on a tiny LLaVA)",
    ('metric_cards/vela/README.md', 'capeval convert vela vela_regressor.safetensors'): "VELA's regressor on Long-CLIP, released weights converted by `capeval convert vela` (tests/test_vela.py runs these calls on tiny ones)",
    ('metric_cards/vela/README.md', 'vela = capeval_plugins.load("vela", aspect="rel")'): "VELA's regressor on Long-CLIP, released weights converted by `capeval convert vela` (tests/test_vela.py runs these calls on tiny ones)",
    ('metric_cards/vela/README.md', 'evaluate.load("vela").compute(images=[...]'): "VELA's regressor on Long-CLIP, released weights converted by `capeval convert vela` (tests/test_vela.py runs these calls on tiny ones)",
    ('metric_cards/vela/README.md', 'capeval score --metric vela -o vela.aspect=flu'): "VELA's regressor on Long-CLIP, released weights converted by `capeval convert vela` (tests/test_vela.py runs these calls on tiny ones)",
    ('metric_cards/vela/README.md', '>>> out = evaluate.load("vela").compute(images=[img]'): "VELA's regressor on Long-CLIP, released weights converted by `capeval convert vela` (tests/test_vela.py runs these calls on tiny ones)",
}

# Model ids of the examples -> the tiny checkpoint of the same architecture.
TINY = {
    "openai/clip-vit-large-patch14": "clip",
    "openai/clip-vit-base-patch32": "clip",
}


def blocks() -> list[tuple[str, int, str, str]]:
    """(page, line, language, text) of every fenced block of the pages."""
    out = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            out.append((page, text[: match.start()].count("\n") + 1, match.group(1), match.group(2)))
    return out


def not_run(page: str, body: str) -> str | None:
    for (where, snippet), reason in NOT_RUN.items():
        if where == page and snippet in body:
            return reason
    return None


RUN = [b for b in blocks() if b[2] in RUNNABLE]


def test_every_not_run_entry_names_an_existing_block():
    stale = [key for key in NOT_RUN if not any(b[0] == key[0] and key[1] in b[3] for b in RUN)]
    assert not stale, f"NOT_RUN entries that match no block any more: {stale}"


# ---------------------------------------------------------------------------------------------------------
# The sandbox: the files the examples name


N = 20  # rows of the sandbox corpus: 2 references each, 40 pairs, enough for MID on the tiny CLIP (2D = 32)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, tiny_clip) -> Path:
    root = tmp_path_factory.mktemp("docs")
    shutil.copytree(EXAMPLES, root / "examples")
    # N distinct images: MID's image covariance needs more distinct images than D (16 on the tiny CLIP)
    names = [f"img{i:02d}.png" for i in range(N)]
    rows = [{"image": name, "caption": f"A photo of thing number {i} on the grass.",
             "references": [f"thing {i} on a lawn", f"a small thing {i} outside"]} for i, name in enumerate(names)]
    for folder in ("images", "data/images", "val2014", "coco/val2014"):
        (root / folder).mkdir(parents=True)
        for i, name in enumerate(names):
            random_image(i, size=(40, 32)).save(root / folder / name)
    for folder in (root, root / "data"):
        (folder / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # predictions and references joined by id (README: --predictions preds.json --references refs.json)
    (root / "preds.json").write_text(json.dumps({str(i): r["caption"] for i, r in enumerate(rows)}))
    (root / "refs.json").write_text(json.dumps({str(i): r["references"] for i, r in enumerate(rows)}))
    for name in ("dog.jpg", "cat.jpg"):
        random_image(len(name), size=(40, 32)).save(root / name, format="PNG")
    _coco_files(root, names)
    if importlib.util.find_spec("skimage") is not None:  # the README's photos (make demo writes them there)
        from capeval_plugins.testing.realistic import write_photos

        write_photos(root / ".cache" / "photos")
    return root


def _coco_files(root: Path, names: list[str]) -> None:
    images = [{"id": i + 1, "file_name": name} for i, name in enumerate(names)]
    # written as COCO's captions are (capital letter, full stop): a capeval scorer refuses PTB-looking corpora
    annotations = [{"id": 10 * (i + 1) + j, "image_id": i + 1, "caption": f"A thing number {i} seen {j}."}
                   for i in range(len(names)) for j in range(2)]
    coco = {"images": images, "annotations": annotations, "type": "captions", "info": {}, "licenses": []}
    for annotation in ("captions_val2014.json", "coco/annotations/captions_val2014.json"):
        (root / annotation).parent.mkdir(parents=True, exist_ok=True)
        (root / annotation).write_text(json.dumps(coco))


def substitute(body: str, tiny: dict[str, str]) -> str:
    for model, path in tiny.items():
        body = body.replace(model, path)
    return body.replace("--images DIR", "--images images")


# Captioner ids of the examples -> the tiny captioner of the same architecture.
TINY_CAPTIONERS = {"Salesforce/blip-image-captioning-base": "blip_caption"}


@pytest.fixture(scope="module")
def tiny(tiny_clip, tiny_root) -> dict[str, str]:
    from capeval_plugins.testing import tiny_checkpoint

    captioners = {model: str(tiny_checkpoint(kind, root=tiny_root)) for model, kind in TINY_CAPTIONERS.items()}
    return {**{model: tiny_clip for model in TINY}, **captioners}


# ---------------------------------------------------------------------------------------------------------
# Python: one namespace per page, seeded with what the prose defines


class _LightningLog:
    """``self`` of a LightningModule's step, for the examples written inside one."""

    def __init__(self) -> None:
        self.logged: dict = {}

    def log(self, name, value, **kwargs) -> None:
        self.logged[name] = value.compute() if hasattr(value, "compute") else value


def _namespace(sandbox: Path) -> dict:
    from pycocotools.coco import COCO

    rows = [json.loads(line) for line in (sandbox / "captions.jsonl").read_text().splitlines()]
    images = [str(sandbox / "images" / r["image"]) for r in rows]
    candidates = [r["caption"] for r in rows]
    references = [r["references"] for r in rows]
    coco = COCO(str(sandbox / "captions_val2014.json"))
    ids = coco.getImgIds()
    coco_res = coco.loadRes([{"image_id": i, "caption": f"A thing number {i}."} for i in ids])
    gts = {i: [a["caption"] for a in coco.imgToAnns[i]] for i in ids}
    res = {i: [f"A thing number {i}."] for i in ids}
    g = torch.Generator().manual_seed(0)
    n, d, r, k = N, 8, 6, 10  # samples, feature size, references = tokens per reference, labels
    mask = torch.ones(n, r, dtype=torch.bool)
    mask[::3, 4:] = False
    features = {
        "image_feats": torch.randn(n, d, generator=g), "caption_feats": torch.randn(n, d, generator=g),
        "cand_feats": torch.randn(n, d, generator=g), "ref_feats": torch.randn(n, r, d, generator=g),
        "ref_mask": mask, "cand_ids": torch.randint(5, 50, (n, r), generator=g), "cand_mask": mask.clone(),
        "ref_ids": torch.randint(5, 50, (n, r), generator=g),
        "cand_emb": torch.randn(n, r, d, generator=g), "ref_emb": torch.randn(n, r, d, generator=g),
        "first_decimal_logprobs": torch.log_softmax(torch.randn(n, k, generator=g), -1),
        "patches": torch.randn(4, 9, d, generator=g), "tokens": torch.randn(n, 7, d, generator=g),
        "patch_mask": torch.ones(4, 9, dtype=torch.bool), "token_mask": torch.ones(n, 7, dtype=torch.bool),
        "image_index": torch.arange(n) % 4, "cosine": torch.rand(n, generator=g),
    }
    features.update(image_features=features["image_feats"], text_features=features["caption_feats"],
                    reference_features=features["ref_feats"][:, 0], candidate_features=features["cand_feats"])
    return {"images": images, "candidates": candidates, "captions": candidates, "references": references,
            "batch_indices": list(range(N)), "self": _LightningLog(), "coco": coco, "coco_res": coco_res,
            "gts": gts, "res": res, "image_id": ids[0], "img": random_image(0, size=(40, 32)), **features}


@pytest.fixture(scope="module")
def namespaces(sandbox):
    return {}


def _run_python(body: str, namespace: dict) -> None:
    """A block as a script, or (a metric card's ``>>>`` examples) as doctests: each output as printed."""
    if ">>>" not in body:
        exec(compile(body, "<docs example>", "exec"), namespace)
        return
    import doctest

    test = doctest.DocTestParser().get_doctest(body, namespace, "<docs example>", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    runner.run(test, out=out.append, clear_globs=False)
    assert not runner.failures, "".join(out)


def _run_bash(body: str, sandbox: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, module in (("capeval", "capeval_plugins.cli"),):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        script.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(["bash", "-e", "-c", body], cwd=sandbox, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD)


@pytest.mark.slow
@pytest.mark.parametrize("page,line,language,body", RUN, ids=[f"{b[0]}:{b[1]}" for b in RUN])
def test_example_runs_as_written(page, line, language, body, sandbox, tiny, namespaces, tmp_path, monkeypatch):
    reason = not_run(page, body)
    if reason:
        pytest.skip(f"not run here: {reason}")
    if not has_java() and re.search(r"\b(cider|bleu\d|meteor|rouge_l|spice|Bleu\()", body):
        pytest.skip("the classic metrics need Java")
    code = substitute(body, tiny)
    if language == "bash":
        proc = _run_bash(code, sandbox, tmp_path)
        assert proc.returncode == 0, f"{page}:{line} failed ({proc.returncode}):\n{code}\n{proc.stderr[-3000:]}"
        return
    monkeypatch.chdir(sandbox)
    namespace = namespaces.setdefault(page, _namespace(sandbox))
    try:
        _run_python(code, namespace)
    except Exception as err:
        raise AssertionError(f"{page}:{line} failed:\n{code}") from err
