"""PAC-S and Polos throughput side by side with the official scoring code, one process, CPU, same inputs and weights.

Official side: OpenAI's CLIP code and Polos's estimator as the ``polos`` package (0.1.3) ships them
(:mod:`capeval_plugins.testing.official_code`). PAC-S's scoring is run as ``pac_score.py`` does it: one image per
caption through the image tower in batches of 64 (``extract_all_images``), captions through ``clip.tokenize`` and
the text tower in batches of 256, numpy normalisation, ``w * clip(cos, 0)``; RefPAC-S encodes the flattened
references in batches of 256 and takes each candidate's maximum in a Python loop. Polos's is the official
``predict(batch_size=32)``. Ours: ``capeval_plugins.load(...)`` on the converted checkpoint (each image once for its
captions, every text of a batch in one pass).

    python benchmarks/pacs_polos_throughput.py [--images 16 --captions-per-image 4 --repeats 3 --size base|tiny]

Random weights of the real architectures (``--size base``: CLIP ViT-B/32 and RoBERTa-base widths; ``tiny``: the
tests' widths); the ratio is what counts (timings on a shared machine move together).
"""
from __future__ import annotations

import argparse
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
    with tempfile.TemporaryDirectory(prefix="capeval-bench-pacs-") as folder:  # the checkpoints: GBs at base size
        run(Path(folder))


def run(root: Path) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--captions-per-image", type=int, default=4)
    parser.add_argument("--references", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", choices=("base", "tiny"), default="base")
    args = parser.parse_args()

    import capeval_plugins
    from capeval_plugins.commands.convert_official import convert_pacs, convert_polos, read_released
    from capeval_plugins.models.encoders.openai_clip import OPENAI_MEAN, OPENAI_STD
    from capeval_plugins.testing import official, official_code
    from capeval_plugins.testing.corpus import caption_corpus
    from capeval_plugins.testing.realistic import photo_crops

    modules = official_code.polos_modules()
    if modules is None:
        raise SystemExit("needs the polos 0.1.3 wheel (make test downloads it into .cache/reference-wheels)")
    torch.manual_seed(0)
    bpe = official_code.bpe_path()
    shape = (dict(width=768, layers=12, image_size=224, patch_size=32, embed_dim=512) if args.size == "base"
             else dict(official.TINY_CLIP))
    size = shape["image_size"]
    n = args.images * args.captions_per_image
    texts = caption_corpus(n + args.references * n, seed=1)
    candidates = texts[:n]
    references = [texts[n + args.references * i: n + args.references * (i + 1)] for i in range(n)]
    crops = photo_crops(args.images, seed=2, long_side=500)
    images = [crops[i // args.captions_per_image] for i in range(n)]

    # PAC-S
    source = official.released_pacs(root / "clip_ViT-B-32.pth", seed=0, bpe=bpe, **shape)
    convert_pacs(source, root / "pacs", "vit-b-32", str(bpe))
    state = torch.load(source, weights_only=True)["state_dict"]
    model = official_code.openai_clip(modules, state)
    transform = official_code.torchvision_transform(size, OPENAI_MEAN, OPENAI_STD)

    def official_pacs() -> np.ndarray:
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
        best = [np.max(c.dot(refs[i * args.references:(i + 1) * args.references].T)) for i, c in enumerate(cand)]
        return 2 * pac * np.asarray(best) / (pac + np.asarray(best))

    ours_metric = capeval_plugins.load("pacscore", model=str(root / "pacs"), batch_size=64)
    ours_metric(images[:2], candidates[:2], references[:2])  # load once
    result = ours_metric(images, candidates, references)
    gap = np.abs(result.extras["refpacscore"].numpy() - official_pacs()).max()
    setting = f"{args.size}, {n} captions, {args.images} images, {args.references} refs"
    report(f"PAC-S+RefPAC-S ({setting}; max |RefPAC-S difference| {gap:.1e})", n,
           *rounds(official_pacs, lambda: ours_metric(images, candidates, references), args.repeats))

    # Polos
    from capeval_plugins.testing.text_encoders import build_roberta

    if args.size == "base":
        from transformers import RobertaConfig, RobertaModel

        tiny = root / "roberta-tiny"
        build_roberta(tiny, 0)
        from transformers import AutoTokenizer

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
    if args.size == "base":  # the released regressor's widths on these encoders
        import io

        ckpt = read_released(source)[0]
        st = official.polos_state(0, root / "roberta", official.bpe_vocabulary_size(bpe), hidden_sizes=(2304, 1152))
        clip_state = official.openai_clip_state(0, official.bpe_vocabulary_size(bpe), **shape)
        st = {k: v for k, v in st.items() if not k.startswith("clip.")} | {f"clip.{k}": v for k, v in clip_state.items()}
        width = 4 * 768 + 6 * shape["embed_dim"]
        st["ff.0.ff.linear_1.weight"] = torch.randn(2304, width) / width ** 0.5
        ckpt["state_dict"] = st
        buffer = io.BytesIO()
        torch.save({"state_dict": st}, buffer)
        source.write_bytes(buffer.getvalue())
        (folder / "hparams.yaml").write_text(official.POLOS_HPARAMS.replace("'24,12'", "'2304,1152'"))
    convert_polos(source, root / "polos", text_tokenizer=str(root / "roberta"), clip_tokenizer=str(bpe))
    state = read_released(source)[0]["state_dict"]  # a Lightning-style file (its hyper-parameters: a Namespace)
    reference = official_code.polos_reference(modules, state, str(root / "roberta"), hidden)
    reference.clip_preprocess = official_code.torchvision_transform(size, OPENAI_MEAN, OPENAI_STD)
    samples = [{"img": i, "mt": c, "refs": list(r)} for i, c, r in zip(images, candidates, references)]
    polos = capeval_plugins.load("polos", model=str(root / "polos"), batch_size=32)
    polos(images[:2], candidates[:2], references[:2])
    report(f"Polos ({setting})", n, *rounds(lambda: reference.predict(samples, batch_size=32),
                                            lambda: polos(images, candidates, references), args.repeats))


if __name__ == "__main__":
    main()
