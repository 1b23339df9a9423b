"""Resume is bit-identical for every metric: a `capeval score` run of every metric that runs on a CPU with tiny
models (image, text, corpus, group, composite and LVLM metrics, and the Java ones where Java is installed),
interrupted by a real SIGINT part-way and run again, writes the same bytes as an uninterrupted run. A sample's
score must not depend on which other samples were still to do (BERTScore's corpus preparation once did)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, has_java, random_image, run
from test_lvlm import scripted_llava, sharp_llava

from capeval_plugins import registry
from capeval_plugins.testing import scratch_folder
from capeval_plugins.testing.corpus import caption_corpus

INTERRUPT = str(Path(__file__).parent / "helpers" / "interrupt_after.py")
N_IMAGES = 21  # MID's fit on the tiny CLIP (16-dimensional features) needs more than 32 (image, reference) pairs


def rigel_checkpoint(llava_next: str) -> str:
    """A Rigel checkpoint on the tiny LLaVA-NeXT (random head, phase 1 format), as tests/test_rigel_metric.py."""
    from capeval_plugins.training.model import RigelSettings, save_checkpoint

    settings = RigelSettings(base_model=llava_next, hidden_size=32, head_hidden=(16,), phase=1)
    torch.manual_seed(0)
    return str(save_checkpoint(str(scratch_folder("capeval-rigel-ckpt-")), settings, settings.build_head()))


def write_corpus(root: Path) -> tuple[Path, Path]:
    """A caption file (two candidates per image, two references each), its images, and the images drawn for
    every caption in advance (the stand-in for Stable Diffusion 3 of DINO-cycle and Redemption Score)."""
    lines = caption_corpus(4 * N_IMAGES + 10, seed=11)
    rows = []
    (root / "images").mkdir()
    for i in range(N_IMAGES):
        random_image(500 + i, size=(40 + i % 5, 36)).save(root / "images" / f"{i}.png")
        refs = [lines[2 * N_IMAGES + i], lines[3 * N_IMAGES + i]]
        rows += [{"image": f"images/{i}.png", "caption": lines[2 * i + k], "references": refs} for k in range(2)]
    captions = root / "captions.jsonl"
    captions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = root / "generated"
    drawn.mkdir()
    texts = list(dict.fromkeys([r["caption"] for r in rows] + [x for r in rows for x in r["references"]]))
    index = []
    for i, text in enumerate(texts):
        random_image(900 + i, size=(28, 28)).save(drawn / f"{i}.png")
        index.append(json.dumps({"caption": text, "image": f"{i}.png"}))
    (drawn / "index.jsonl").write_text("\n".join(index) + "\n")
    return captions, drawn


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_every_metric_resumes_to_the_same_bytes(tiny_root, tmp_path):
    from capeval_plugins.testing import tiny_checkpoint

    models = {k: str(tiny_checkpoint(k, root=tiny_root))
              for k in ("clip", "roberta", "deberta_v3", "vilt", "dino", "pacs", "pacs_pp", "polos")}
    judge = scripted_llava(("▁[/INST]", "▁", "0", ".", "8", "A", "▁dog"))  # writes a score: FLEUR and DISCODE
    # have numbers (the same for every sample: its layers add nothing); Rigel reads a random, image-dependent one
    captions, drawn = write_corpus(tmp_path)
    options = {
        "clipscore": {"model": models["clip"]}, "refclipscore": {"model": models["clip"]},
        "mid": {"model": models["clip"]}, "msd_score": {"model": models["clip"]}, "soft_msd": {"model": models["clip"]},
        "bertscore": {"model": models["roberta"], "batch_size": 4},  # texts embedded in chunks of 4
        "bleu4": {}, "rouge_l": {}, "cider": {},
        "fleur": {"model": judge}, "discode": {"model": judge},
        "rigel": {"checkpoint": rigel_checkpoint(sharp_llava())},
        "vilbertscore": {"model": models["vilt"]},
        "pacscore": {"model": models["pacs"]}, "refpacscore": {"model": models["pacs"]},
        "pacscore_pp": {"model": models["pacs_pp"]}, "refpacscore_pp": {"model": models["pacs_pp"]},
        "polos": {"model": models["polos"], "batch_size": 8},
        "dino_cycle": {"model": models["dino"], "generated_images": str(drawn)},
        "redemption_score": {"clip_model": models["clip"], "dino_model": models["dino"], "generated_images": str(drawn),
                             "bertscore_model": models["deberta_v3"], "bertscore_num_layers": 2},
    }
    if has_java():  # PTB tokenisation and METEOR
        options["meteor"] = {}
    else:
        options = {k: {**v, "tokenize": False} if k in ("bleu4", "rouge_l", "cider") else v for k, v in options.items()}
    args = [a for name in options for a in ("-m", name)]
    args += [a for name, opts in options.items() for key, value in opts.items()
             for a in ("-o", f"{name}.{key}={value}")]

    def command(out: Path) -> list[str]:
        return [PYTHON, INTERRUPT, "score", *args, "--batch-size", "8", "--captions", str(captions),
                "--out", str(out), "--quiet"]

    env = {**os.environ, "CAPEVAL_TEST_STOP_AFTER": "0"}
    whole = tmp_path / "whole.jsonl"
    run(command(whole), env=env, timeout=900)
    out = tmp_path / "resumed.jsonl"
    # Stop once BERTScore has done 6 of its 11 batches: its texts embedded in chunks of 4 then differ, on
    # this corpus, from those of the whole pass in the last bits (on the tiny RoBERTa).
    sizes = [-(-2 * N_IMAGES // opts.get("batch_size", 8)) for opts in options.values()]
    plan = sorted(((k + 1) / n, i, k) for i, n in enumerate(sizes) for k in range(n))  # the runner's order
    stop = next(j for j, (_, i, k) in enumerate(plan, 1) if i == list(options).index("bertscore") and k == 5)
    first = subprocess.run(command(out), capture_output=True, text=True, timeout=900,
                           env={**env, "CAPEVAL_TEST_STOP_AFTER": str(stop)})
    assert first.returncode == 130, first.stderr[-3000:]
    assert f"interrupted after {stop} of {len(plan)} batches" in first.stderr, first.stderr[-1500:]
    second = subprocess.run(command(out), capture_output=True, text=True, timeout=900, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert out.read_bytes() == whole.read_bytes()
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert len(rows) == 2 * N_IMAGES and all(name in rows[0] for name in options)
    assert all(row[name] is not None for row in rows for name in options)  # a number everywhere, no NaN
    for name in options:  # every default stays inside the range its paper states (MetricInfo.score_range)
        bounds = registry.get(name).info.score_range
        if bounds is not None:
            values = [row[name] for row in rows]
            assert bounds[0] <= min(values) and max(values) <= bounds[1], (name, bounds, min(values), max(values))
    assert json.loads(second.stdout.strip().splitlines()[-1])["batches_resumed"] == stop
