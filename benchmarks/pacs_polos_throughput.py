"""PAC-S and Polos throughput side by side with the official scoring code, one process, CPU, same inputs and weights.

Official side: OpenAI's CLIP code and Polos's estimator as the ``polos`` package (0.1.3) ships them
(:mod:`capeval_plugins.testing.official_code`). PAC-S's scoring is run as ``pac_score.py`` does it: one image per
caption through the image tower in batches of 64 (``extract_all_images``), captions through ``clip.tokenize`` and
the text tower in batches of 256, numpy normalisation, ``w * clip(cos, 0)``; RefPAC-S encodes the flattened
references in batches of 256 and takes each candidate's maximum in a Python loop. Polos's is the official
``predict(batch_size=32)``. Ours: ``capeval_plugins.load(...)`` on the converted checkpoint (each image once for its
captions, every text of a batch in one pass).

    python benchmarks/pacs_polos_throughput.py [--images 16 --captions-per-image 4 --repeats 3 --size base|tiny]
    python benchmarks/pacs_polos_throughput.py --whole-run [--rounds 3 --threads 1]
    make bench-pacs-polos          # both, after fetching the official code (pinned wheels, never installed)

``--whole-run``: each side a process of its own per round, as a user runs it (Python, imports, the checkpoint
load, reading and decoding the JPEG files, scoring, writing the scores): the official side a script that loads
the released checkpoint file with ``torch.load``, builds the official model and scores as above (PAC-S opens
each caption's image file, Polos's samples each hold their image opened from its file, as its README does);
ours ``capeval score -m pacscore -o reference_extras=true`` and ``capeval score -m polos`` on a caption file
(each row its image's file and references). CPU seconds of each process tree (``wait4``), peak memory,
interleaved rounds after an untimed run of each, every per-sample RefPAC-S / Polos value compared.

Random weights of the real architectures (``--size base``: CLIP ViT-B/32 and RoBERTa-base widths; ``tiny``: the
tests' widths); the ratio is what counts (timings on a shared machine move together).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.simplefilter("ignore")


def rounds(official, ours, repeats: int) -> tuple[float, float, float, float]:
    """Interleaved rounds (official first, then ours, alternating the order): the best wall and process-CPU
    seconds of each side."""
    times: dict[str, list[tuple[float, float]]] = {"official": [], "ours": []}
    for r in range(repeats):
        order = (("official", official), ("ours", ours)) if r % 2 == 0 else (("ours", ours), ("official", official))
        for name, fn in order:
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in times.items()}
    return (*best["official"], *best["ours"])


def report(what: str, n: int, official_wall: float, official_cpu: float, ours_wall: float, ours_cpu: float) -> None:
    print(f"{what}: official {n / official_wall:.1f} captions/s ({official_cpu:.2f} CPU-s), capeval "
          f"{n / ours_wall:.1f} captions/s ({ours_cpu:.2f} CPU-s), ratio {official_wall / ours_wall:.2f}x wall, "
          f"{official_cpu / ours_cpu:.2f}x CPU")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # one side of a whole run, in a process of its own
        return child(*sys.argv[2:])
    with tempfile.TemporaryDirectory(prefix="capeval-bench-pacs-") as folder:  # the checkpoints: GBs at base size
        run(Path(folder))


def official_refpacs(modules, model, transform, images, candidates, references) -> np.ndarray:
    """RefPAC-S as PAC-S's scripts compute it: one image per caption through the image tower in batches of 64,
    texts through ``clip.tokenize`` and the text tower in batches of 256, numpy normalisation, each candidate's
    best reference in a Python loop."""
    n = len(candidates)
    with torch.no_grad():
        feats = [model.encode_image(torch.stack([transform(i) for i in images[s:s + 64]])).numpy()
                 for s in range(0, n, 64)]
        img = np.vstack(feats)
        tok = modules.clip.tokenize(["A photo depicts " + c for c in candidates], truncate=True)
        cand = np.vstack([model.encode_text(tok[s:s + 256]).numpy() for s in range(0, n, 256)])
        flat = [r for refs in references for r in refs]
        rtok = modules.clip.tokenize(["A photo depicts " + r for r in flat], truncate=True)
        refs = np.vstack([model.encode_text(rtok[s:s + 256]).numpy() for s in range(0, len(flat), 256)])
    img = img / np.sqrt(np.sum(img ** 2, axis=1, keepdims=True))
    cand = cand / np.sqrt(np.sum(cand ** 2, axis=1, keepdims=True))
    refs = refs / np.sqrt(np.sum(refs ** 2, axis=1, keepdims=True))
    pac = 2.0 * np.clip(np.sum(img * cand, axis=1), 0, None)
    ends = np.cumsum([len(r) for r in references])
    best = [np.max(c.dot(refs[e - len(r):e].T)) for c, r, e in zip(cand, references, ends)]
    return 2 * pac * np.asarray(best) / (pac + np.asarray(best))


def child(side: str, root: str, out: str) -> None:
    """The official side of a whole run: ``side`` is ``pacs`` or ``polos``; the inputs and checkpoints are under
    ``root`` (see :func:`whole_run`); the scores go to ``out`` as JSON."""
    from PIL import Image

    from capeval_plugins.models.encoders.openai_clip import OPENAI_MEAN, OPENAI_STD
    from capeval_plugins.testing import official_code

    folder = Path(root)
    setting = json.loads((folder / "setting.json").read_text())
    rows = [json.loads(line) for line in (folder / "captions.jsonl").read_text().splitlines()]
    modules = official_code.polos_modules()
    transform = official_code.torchvision_transform(setting["size"], OPENAI_MEAN, OPENAI_STD)

    def image(name: str) -> Image.Image:
        with Image.open(folder / "images" / name) as img:
            return img.convert("RGB")

    if side == "pacs":
        state = torch.load(folder / "clip_ViT-B-32.pth", map_location="cpu", weights_only=True)["state_dict"]
        model = official_code.openai_clip(modules, state)
        scores = official_refpacs(modules, model, transform, [image(r["image"]) for r in rows],
                                  [r["caption"] for r in rows], [r["references"] for r in rows])
    else:
        state = torch.load(folder / "polos.ckpt", map_location="cpu", weights_only=True)["state_dict"]
        reference = official_code.polos_reference(modules, state, str(folder / "roberta"), setting["hidden"])
        reference.clip_preprocess = transform
        samples = [{"img": image(r["image"]), "mt": r["caption"], "refs": r["references"]} for r in rows]
        scores = reference.predict(samples, batch_size=32)
    Path(out).write_text(json.dumps([float(s) for s in scores]))


def run(root: Path) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--captions-per-image", type=int, default=4)
    parser.add_argument("--references", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="in-process rounds")
    parser.add_argument("--size", choices=("base", "tiny"), default="base")
    parser.add_argument("--whole-run", action="store_true", help="each side a process of its own per round")
    parser.add_argument("--rounds", type=int, default=3, help="whole-run rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every whole-run side")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="whole runs without the untimed first run of each side (bytecode and page caches already "
                             "made by an earlier run)")
    args = parser.parse_args()

    import capeval_plugins
    from capeval_plugins.models.encoders.openai_clip import OPENAI_MEAN, OPENAI_STD
    from capeval_plugins.testing import official_code
    from capeval_plugins.testing.corpus import caption_corpus
    from capeval_plugins.testing.realistic import photo_crops

    missing = [name for name in ("ftfy", "pytorch_lightning") if importlib.util.find_spec(name) is None]
    modules = None if missing else official_code.polos_modules()
    if modules is None:  # a clear skip, not a failure: the official code is fetched, never vendored
        why = (f"{', '.join(missing)} not installed (the pacs and lightning extras)" if missing else
               f"the official code (requirements/reference-code.txt: polos 0.1.3, pytorch-nlp 0.5.0) is not in "
               f"{official_code.WHEELS}; `make bench-pacs-polos` downloads it there")
        print(f"pacs_polos_throughput: skipped: {why}")
        return
    torch.manual_seed(0)
    bpe = official_code.bpe_path()
    shape, pacs_state, polos_state, hidden = build_checkpoints(root, args.size, bpe)
    size = shape["image_size"]
    n = args.images * args.captions_per_image
    texts = caption_corpus(n + args.references * n, seed=1)
    candidates = texts[:n]
    references = [texts[n + args.references * i: n + args.references * (i + 1)] for i in range(n)]
    crops = photo_crops(args.images, seed=2, long_side=500)
    images = [crops[i // args.captions_per_image] for i in range(n)]
    setting = f"{args.size}, {n} captions, {args.images} images, {args.references} refs"
    if args.whole_run:
        return whole_run(root, args, setting, crops, candidates, references, pacs_state, polos_state, hidden)

    # PAC-S
    model = official_code.openai_clip(modules, pacs_state)
    transform = official_code.torchvision_transform(size, OPENAI_MEAN, OPENAI_STD)

    def official_pacs() -> np.ndarray:
        return official_refpacs(modules, model, transform, images, candidates, references)

    ours_metric = capeval_plugins.load("pacscore", model=str(root / "pacs"), batch_size=64, reference_extras=True)
    ours_metric(images[:2], candidates[:2], references[:2])  # load once
    result = ours_metric(images, candidates, references)
    gap = np.abs(result.extras["refpacscore"].numpy() - official_pacs()).max()
    report(f"PAC-S+RefPAC-S ({setting}; max |RefPAC-S difference| {gap:.1e})", n,
           *rounds(official_pacs, lambda: ours_metric(images, candidates, references), args.repeats))

    # Polos
    reference = official_code.polos_reference(modules, polos_state, str(root / "roberta"), hidden)
    reference.clip_preprocess = official_code.torchvision_transform(size, OPENAI_MEAN, OPENAI_STD)
    samples = [{"img": i, "mt": c, "refs": list(r)} for i, c, r in zip(images, candidates, references)]
    polos = capeval_plugins.load("polos", model=str(root / "polos"), batch_size=32)
    polos(images[:2], candidates[:2], references[:2])
    report(f"Polos ({setting})", n, *rounds(lambda: reference.predict(samples, batch_size=32),
                                            lambda: polos(images, candidates, references), args.repeats))


def build_checkpoints(root: Path, size: str, bpe: Path) -> tuple[dict, dict, dict, str]:
    """The released PAC-S file (``root/clip_ViT-B-32.pth``) and Polos files (``root/reprod``, its RoBERTa in
    ``root/roberta``), random weights of the real widths, converted into ``root/pacs`` and ``root/polos``; returns
    the CLIP shape, both state dicts and Polos's regressor widths."""
    from capeval_plugins.commands.convert_official import convert_pacs, convert_polos, read_released
    from capeval_plugins.testing import official
    from capeval_plugins.testing.text_encoders import build_roberta

    shape = (dict(width=768, layers=12, image_size=224, patch_size=32, embed_dim=512) if size == "base"
             else dict(official.TINY_CLIP))
    source = official.released_pacs(root / "clip_ViT-B-32.pth", seed=0, bpe=bpe, **shape)
    convert_pacs(source, root / "pacs", "vit-b-32", str(bpe))
    pacs_state = torch.load(source, weights_only=True)["state_dict"]

    if size == "base":
        from transformers import AutoTokenizer, RobertaConfig, RobertaModel

        tiny = root / "roberta-tiny"
        build_roberta(tiny, 0)
        tokenizer = AutoTokenizer.from_pretrained(tiny)
        config = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=514, type_vocab_size=1,
                               layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)
        RobertaModel(config).save_pretrained(root / "roberta")
        tokenizer.save_pretrained(root / "roberta")
        hidden = "2304,1152"
    else:
        build_roberta(root / "roberta", 0)
        hidden = "24,12"
    folder = root / "reprod"
    source = official.released_polos(folder, root / "roberta", bpe, seed=0)
    if size == "base":  # the released regressor's widths on these encoders
        import io

        st = official.polos_state(0, root / "roberta", official.bpe_vocabulary_size(bpe), hidden_sizes=(2304, 1152))
        clip_state = official.openai_clip_state(0, official.bpe_vocabulary_size(bpe), **shape)
        st = {k: v for k, v in st.items() if not k.startswith("clip.")} | {f"clip.{k}": v for k, v in clip_state.items()}
        width = 4 * 768 + 6 * shape["embed_dim"]
        st["ff.0.ff.linear_1.weight"] = torch.randn(2304, width) / width ** 0.5
        buffer = io.BytesIO()
        torch.save({"state_dict": st}, buffer)
        source.write_bytes(buffer.getvalue())
        (folder / "hparams.yaml").write_text(official.POLOS_HPARAMS.replace("'24,12'", "'2304,1152'"))
    convert_polos(source, root / "polos", text_tokenizer=str(root / "roberta"), clip_tokenizer=str(bpe))
    polos_state = read_released(source)[0]["state_dict"]  # a Lightning-style file (its hyper-parameters: a Namespace)
    return shape, pacs_state, polos_state, hidden


def whole_run(root: Path, args, setting: str, crops, candidates, references, pacs_state, polos_state,
              hidden: str) -> None:
    """Both metrics as whole processes side by side (see the module's docstring)."""
    from common import interleaved_processes, process_env, report_processes

    from capeval_plugins.testing import official_code

    (root / "images").mkdir()
    names = [f"photo_{k:04d}.jpg" for k in range(len(crops))]
    for name, crop in zip(names, crops):
        crop.save(root / "images" / name, quality=95)
    captions = root / "captions.jsonl"
    captions.write_text("".join(json.dumps({"image": names[i // args.captions_per_image], "caption": c,
                                            "references": list(r)}) + "\n"
                                for i, (c, r) in enumerate(zip(candidates, references))))
    torch.save({"state_dict": polos_state}, root / "polos.ckpt")
    (root / "setting.json").write_text(json.dumps({"size": 224 if args.size == "base" else 32, "hidden": hidden}))
    env = process_env(args.threads)
    if official_code._extracted is not None:  # the wheels' code, unpacked once, importable as if installed
        env["PYTHONPATH"] += os.pathsep + str(official_code._extracted)
    capeval = [sys.executable, "-m", "capeval_plugins.cli", "score", "--captions", str(captions), "--images",
               str(root / "images"), "--quiet"]
    for metric, options, batch, key in (("pacs", ["-m", "pacscore", "-o", "reference_extras=true"], 64,
                                         "pacscore.refpacscore"), ("polos", ["-m", "polos"], 32, "polos")):
        outs = {side: root / f"{metric}-{side}.out" for side in ("official", "capeval")}
        commands = {"official": lambda m=metric, o=outs["official"]: [sys.executable, __file__, "--child", m,
                                                                        str(root), str(o)],
                    "capeval": lambda m=metric, op=options, b=batch, o=outs["capeval"]: [
                        *capeval, *op, "--model", str(root / m), "--batch-size", str(b), "--out", str(o)]}
        times = interleaved_processes(commands, env, args.rounds,
                                      before=lambda side, outs=outs: outs[side].unlink(missing_ok=True),
                                      warm_up=not args.no_warm_up)
        official = np.array(json.loads(outs["official"].read_text()))
        ours = np.array([json.loads(line)[key] for line in outs["capeval"].read_text().splitlines()])
        print(f"\n{'PAC-S+RefPAC-S' if metric == 'pacs' else 'Polos'} ({setting}), threads {args.threads}, "
              f"{args.rounds} rounds, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        report_processes(times, {"capeval": f"max |{key} - official| {np.abs(ours - official).max():.1e}"})


if __name__ == "__main__":
    main()
