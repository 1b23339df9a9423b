"""PAC-S, RefPAC-S, PAC-S++ and Polos side by side with their official code on random weights of the real
architectures (tiny widths), OpenAI's real BPE vocabulary, realistic captions and real photographs; and the
released-checkpoint converters, which read pickles safely.

The official code is the ``polos`` package (0.1.3: its estimator and its copy of OpenAI's CLIP model, tokenizer
and vocabulary, the files PAC-S vendors as ``models/clip``), run as is from its wheel
(:mod:`capeval_plugins.testing.official_code`); these tests skip without it (``make test`` downloads it).
"""
from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_image

import capeval_plugins
from capeval_plugins.commands.convert import ConversionError
from capeval_plugins.commands.convert_official import convert_pacs, convert_polos, read_released
from capeval_plugins.models.encoders.openai_clip import LAION_MEAN, LAION_STD, OPENAI_MEAN, OPENAI_STD, merge_lora
from capeval_plugins.testing import official, official_code
from capeval_plugins.testing.corpus import caption_corpus

pytestmark = pytest.mark.filterwarnings("ignore")
CLIP_SIZE = 32  # the tiny CLIP's input side (official: 224)
AWKWARD = ["A photo of a dog’s toy &amp; a ﬁsh", "ＦＵＬＬ width TEXT, café — “quoted”", "a man\n\triding   a bike",
           "x " * 120]


@pytest.fixture(scope="module")
def modules():
    found = official_code.polos_modules()
    if found is None:
        pytest.skip("the official code (polos 0.1.3) is not here: `make test` downloads it into .cache/reference-wheels")
    return found


@pytest.fixture(scope="module")
def corpus():
    """Realistic captions (the synthetic caption corpus plus texts ftfy and the truncation act on) over real
    photographs of several sizes and aspect ratios, two captions per image, 1-3 references each."""
    pytest.importorskip("skimage")
    from capeval_plugins.testing.realistic import photo_crops

    images = photo_crops(6, seed=3, long_side=97) + [random_image(9, size=(35, 61))]
    texts = caption_corpus(40, seed=5) + AWKWARD
    candidates = texts[: 2 * len(images)]
    pool = texts[2 * len(images):]
    references = [[pool[(i + j) % len(pool)] for j in range(1 + i % 3)] for i in range(len(candidates))]
    return [images[i // 2] for i in range(len(candidates))], candidates, references


def official_pacs(model, modules, images, candidates, references, mean, std, w=2.0):
    """PAC-S and RefPAC-S as pac_score.py / compute_metrics.py compute them: float32 features from
    ``encode_image`` / ``encode_text`` of ``clip.tokenize("A photo depicts " + c, truncate=True)``, normalised in
    numpy, w * clip(cos, 0); the unclipped best reference cosine; 2 p s / (p + s)."""
    transform = official_code.torchvision_transform(CLIP_SIZE, mean, std)
    with torch.no_grad():
        img = model.encode_image(torch.stack([transform(i) for i in images])).numpy()
        cand = model.encode_text(modules.clip.tokenize(["A photo depicts " + c for c in candidates], truncate=True)).numpy()
        img = img / np.sqrt(np.sum(img ** 2, axis=1, keepdims=True))
        cand = cand / np.sqrt(np.sum(cand ** 2, axis=1, keepdims=True))
        pac = w * np.clip(np.sum(img * cand, axis=1), 0, None)
        best = []
        for c, refs in zip(cand, references):
            r = model.encode_text(modules.clip.tokenize(["A photo depicts " + x for x in refs], truncate=True)).numpy()
            r = r / np.sqrt(np.sum(r ** 2, axis=1, keepdims=True))
            best.append(np.max(c.dot(r.T)))
    best = np.asarray(best)
    return pac, 2 * pac * best / (pac + best)


@pytest.fixture(scope="module")
def released(tmp_path_factory, modules):
    """Released-format PAC-S (ViT-B/32 and open_clip ViT-L/14 layouts) and PAC-S++ files on OpenAI's real
    vocabulary, converted."""
    root = tmp_path_factory.mktemp("released")
    bpe = str(official_code.bpe_path())
    out = {}
    for name, lora, backbone in (("pacs", 0, "vit-b-32"), ("open_clip", 0, "open_clip-vit-l-14"),
                                 ("pacs_pp", 4, "vit-l-14")):
        source = official.released_pacs(root / f"{name}.pth", seed=len(out) + 1, bpe=bpe, lora_rank=lora)
        convert_pacs(source, root / name, backbone, bpe)
        out[name] = (source, str(root / name))
    return out


def test_clipscore_and_refclipscore_equal_the_official_clipscore_code(released, modules, corpus):
    """jmhessel/clipscore feeds OpenAI's CLIP through clip.load's transform and clip.tokenize: a centre crop at
    round((extent - size) / 2) (transformers' processor floors it: one pixel off at 640x427) and ftfy with HTML
    entities unescaped twice ("“quoted”", "&amp;", "ﬁ" were other tokens). PAC-S's formula at w = 2.5 is
    CLIP-S; its reference term, unclamped, is the official code's RefCLIP-S."""
    images, candidates, references = corpus
    images = images + [random_image(11, size=(61, 35)), random_image(12, size=(640, 427))]
    candidates = candidates + AWKWARD[:2]
    references = references + [AWKWARD[2:], AWKWARD[:1]]
    source, folder = released["pacs"]
    model = official_code.openai_clip(modules, torch.load(source, weights_only=True)["state_dict"])
    clip_s, refclip_s = official_pacs(model, modules, images, candidates, references, OPENAI_MEAN, OPENAI_STD, w=2.5)
    ours = capeval_plugins.load("clipscore", model=folder, reference_extras=True, clamp_reference=False,
                                batch_size=5)(images, candidates, references)
    np.testing.assert_allclose(ours.scores.numpy(), clip_s, atol=2e-5)
    np.testing.assert_allclose(ours.extras["refclipscore"].numpy(), refclip_s, atol=2e-5)
    ref = capeval_plugins.load("refclipscore", model=folder, clamp_reference=False)(images, candidates, references)
    np.testing.assert_allclose(ref.scores.numpy(), refclip_s, atol=2e-5)
    processor = capeval_plugins.load("clipscore", model=folder, preprocessing="transformers")(images, candidates)
    assert np.abs(processor.scores.numpy() - clip_s).max() > 1e-3  # the processor's numbers are torchmetrics'


@pytest.mark.parametrize("kind", ["pacs", "open_clip"])
def test_pacs_and_refpacs_equal_the_official_code(released, modules, corpus, kind):
    images, candidates, references = corpus
    source, folder = released[kind]
    state = torch.load(source, weights_only=True)["state_dict"]
    model = official_code.openai_clip(modules, state, gelu=kind == "open_clip")
    mean, std = (LAION_MEAN, LAION_STD) if kind == "open_clip" else (OPENAI_MEAN, OPENAI_STD)
    pac, refpac = official_pacs(model, modules, images, candidates, references, mean, std)
    assert pac.std() > 0  # not every score clipped to 0
    options = {"model": folder, "batch_size": 5}
    if kind == "open_clip":
        options["backbone"] = "open_clip-vit-l-14"
    ours = capeval_plugins.load("pacscore", reference_extras=True, **options)(images, candidates, references)
    np.testing.assert_allclose(ours.scores.numpy(), pac, atol=2e-5)
    np.testing.assert_allclose(ours.extras["refpacscore"].numpy(), refpac, atol=2e-5)
    ref = capeval_plugins.load("refpacscore", **options)(images, candidates, references)
    np.testing.assert_allclose(ref.scores.numpy(), refpac, atol=2e-5)


def test_pacs_pp_folds_the_lora_factors_as_the_official_scoring_applies_them(released, modules, corpus):
    """PAC-S++'s official scoring adds (B @ A) / r to the attention projections and the patch embedding and
    leaves the MLP layers' factors out (their merge flag is set before the weights load): the converted model
    equals OpenAI's CLIP with exactly those weights."""
    images, candidates, references = corpus
    source, folder = released["pacs_pp"]
    state = torch.load(source, weights_only=True)["state_dict"]
    r = 4
    folded = {k: v for k, v in state.items() if "lora_" not in k}
    for key in [k for k in state if k.endswith("attn.in_proj_weight")]:
        folded[key] = state[key] + state[key + "_lora_B"] @ state[key + "_lora_A"] / r
    for key in [k for k in state if k.endswith("attn.out_proj.weight")]:
        module = key[: -len(".weight")]
        folded[key] = state[key] + state[module + ".lora_B"] @ state[module + ".lora_A"] / r
    conv = state["visual.conv1.weight"]
    folded["visual.conv1.weight"] = conv + (state["visual.conv1.lora_B"] @ state["visual.conv1.lora_A"]).view(conv.shape) / r
    model = official_code.openai_clip(modules, folded)
    pac, refpac = official_pacs(model, modules, images, candidates, references, OPENAI_MEAN, OPENAI_STD)
    ours = capeval_plugins.load("pacscore_pp", model=folder, reference_extras=True)(images, candidates, references)
    np.testing.assert_allclose(ours.scores.numpy(), pac, atol=2e-5)
    np.testing.assert_allclose(ours.extras["refpacscore_pp"].numpy(), refpac, atol=2e-5)
    merged, _, left_out = merge_lora(state, "merge")
    assert left_out == [] and not torch.equal(merged["transformer.resblocks.0.mlp.c_fc.weight"],
                                              state["transformer.resblocks.0.mlp.c_fc.weight"])


@pytest.mark.parametrize("kind", ["pacs", "pacs_pp"])
def test_sentence_average_equals_the_official_code_one_sentence_at_a_time(released, modules, corpus, kind):
    """CaptionEvalKit's --sentence-average for PAC-S / PAC-S++: every sentence of a candidate becomes a row of its own
    (same image), scored by the official PACScore; the candidate's score is the mean of its rows. Here each sentence
    goes through the official code alone (a plain loop, the splitter re-written in test_clipscore.py); capeval scores
    all sentences of a batch in one pass."""
    from test_clipscore import split_like_the_toolkit

    images, candidates, _ = corpus
    long = [" ".join(candidates[i: i + 3]) + "\n" + candidates[-1 - i] for i in range(len(candidates))]
    source, folder = released[kind]
    state = torch.load(source, weights_only=True)["state_dict"]
    if kind == "pacs_pp":
        state, _, _ = merge_lora(state)
    model = official_code.openai_clip(modules, state)
    expected = []
    for image, caption in zip(images, long):
        per = [official_pacs(model, modules, [image], [s], [["x"]], OPENAI_MEAN, OPENAI_STD)[0][0]
               for s in split_like_the_toolkit(caption)]
        expected.append(np.mean(per))
    assert max(len(split_like_the_toolkit(c)) for c in long) >= 3
    name = "pacscore" if kind == "pacs" else "pacscore_pp"
    ours = capeval_plugins.load(name, model=folder, batch_size=5, sentence_average=True)(images, long)
    np.testing.assert_allclose(ours.scores.numpy(), expected, atol=2e-5)


def test_polos_equals_the_official_estimator(tmp_path, modules, corpus):
    """The official PolosEstimator's predict (one sample per batch: its layer-norm statistics and reference
    truncation couple the samples of a batch) against polos over the whole corpus in batches of 5."""
    from capeval_plugins.testing.text_encoders import build_simcse_roberta

    images, candidates, references = corpus
    bpe = official_code.bpe_path()
    build_simcse_roberta(tmp_path / "roberta", 0)
    source = official.released_polos(tmp_path / "reprod", tmp_path / "roberta", bpe, seed=2)
    convert_polos(source, tmp_path / "polos", text_tokenizer=str(tmp_path / "roberta"), clip_tokenizer=str(bpe))
    state = read_released(source)[0]
    reference = official_code.polos_reference(modules, state["state_dict"], str(tmp_path / "roberta"), "24,12")
    reference.clip_preprocess = official_code.torchvision_transform(CLIP_SIZE, OPENAI_MEAN, OPENAI_STD)
    samples = [{"img": i, "mt": c, "refs": list(r)} for i, c, r in zip(images, candidates, references)]
    expected = np.asarray([reference.predict([s])[0] for s in samples])
    assert expected.std() > 1e-4
    ours = capeval_plugins.load("polos", model=str(tmp_path / "polos"), batch_size=5)(images, candidates, references)
    np.testing.assert_allclose(ours.scores.numpy(), expected, atol=2e-5)
    # with equal reference counts the official batch of all samples differs only by its shared statistics
    assert 0 <= ours.scores.min() and ours.scores.max() <= 1
    # the official README's batched reading, predict(batch_size=8): statistics pooled over each batch of 8 (its
    # candidates, each reference slot), references cut to the fewest of the batch (1-3 here); ours in batches of
    # 5 and of 64, which change nothing
    batched = np.asarray(reference.predict(samples, batch_size=8))
    assert np.abs(batched - expected).max() > 1e-3  # the two readings differ visibly
    for batch_size in (5, 64):
        pooled = capeval_plugins.load("polos", model=str(tmp_path / "polos"), batch_size=batch_size,
                                      official_batch_size=8)(images, candidates, references)
        np.testing.assert_allclose(pooled.scores.numpy(), batched, atol=2e-5)
    from capeval_plugins.torchmetrics import Polos

    with pytest.raises(ValueError, match="whole corpus"):  # streamed updates would each pool on their own
        Polos(model=str(tmp_path / "polos"), official_batch_size=8)


def test_scores_do_not_depend_on_the_batch(corpus, tiny_root):
    from capeval_plugins.testing import tiny_checkpoint

    images, candidates, references = corpus
    for name, kind in (("polos", "polos"), ("refpacscore_pp", "pacs_pp")):
        folder = str(tiny_checkpoint(kind, root=tiny_root))
        one = capeval_plugins.load(name, model=folder, batch_size=1)(images, candidates, references)
        many = capeval_plugins.load(name, model=folder, batch_size=64)(images[::-1], candidates[::-1], references[::-1])
        np.testing.assert_allclose(one.scores.numpy(), many.scores.numpy()[::-1], atol=1e-6)


def test_pacscore_and_clipscore_on_one_checkpoint_share_the_model(tiny_root):
    from capeval_plugins.testing import tiny_checkpoint

    folder = str(tiny_checkpoint("pacs", root=tiny_root))
    pacs = capeval_plugins.load("pacscore", model=folder)
    clip = capeval_plugins.load("clipscore", model=folder)
    assert pacs.encoder is clip.encoder  # CLIPScore feeds an OpenAI CLIP as the official code does, as PAC-S
    assert pacs.encoder.clip.model is capeval_plugins.load("clipscore", model=folder, preprocessing="transformers").encoder.model


def test_a_pickle_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for name, content in (("top.pth", Payload()), ("nested.pth", {"state_dict": {"w": torch.ones(2)}, "x": Payload()}),
                          ("eval.ckpt", {"state_dict": {"w": torch.ones(1)}, "callbacks": {eval: 1}})):
        buffer = io.BytesIO()
        torch.save(content, buffer)
        (tmp_path / name).write_bytes(buffer.getvalue())
        with pytest.raises(ConversionError, match="refused"):
            convert_pacs(tmp_path / name, tmp_path / "out")
        with pytest.raises(ConversionError, match="refused"):
            convert_polos(tmp_path / name, tmp_path / "out2")
    raw = tmp_path / "raw.pth"  # a bare pickle, not a torch archive
    raw.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ConversionError):
        convert_pacs(raw, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_lightning_metadata_is_read_as_inert_stand_ins(tmp_path):
    import argparse

    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": argparse.Namespace(pool="cls")}, buffer)
    (tmp_path / "x.ckpt").write_bytes(buffer.getvalue())
    loaded, stand_ins = read_released(tmp_path / "x.ckpt")
    assert stand_ins == ["argparse.Namespace"] and torch.equal(loaded["state_dict"]["w"], torch.ones(2))
    assert type(loaded["hyper_parameters"]).__module__ != "argparse"


def test_default_checkpoint_is_the_converted_folder_and_its_absence_says_what_to_do(tmp_path, monkeypatch):
    from capeval_plugins import preflight

    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path))
    for name, released_file in (("pacscore", "clip_ViT-B-32.pth"), ("pacscore_pp", "PAC++_clip_ViT-L-14.pth"),
                                ("polos", "reprod")):
        said = "; ".join(preflight.problems({name: capeval_plugins.load(name)}))
        assert released_file in said and "capeval convert" in said, said
    assert capeval_plugins.load("pacscore", backbone="open_clip-vit-l-14").checkpoint().endswith(
        "models/pacs-open_clip-vit-l-14")
    with pytest.raises(ValueError, match="backbone"):
        capeval_plugins.load("pacscore", backbone="vit-l-14")


def test_a_pacs_folder_under_pacscore_pp_is_refused(tiny_root):
    from capeval_plugins.testing import tiny_checkpoint

    folder = str(tiny_checkpoint("pacs", root=tiny_root))
    with pytest.raises(ValueError, match="pacscore"):
        capeval_plugins.load("pacscore_pp", model=folder)([random_image(0)], ["a dog"])


def test_converter_accounts_for_every_parameter(tmp_path):
    bpe = official.write_bpe(tmp_path / "bpe.txt.gz")
    source = official.released_pacs(tmp_path / "x.pth", bpe=bpe, lora_rank=4)
    report = convert_pacs(source, tmp_path / "out", "vit-b-32", str(bpe))
    assert report.variant == "pacs_pp" and len(report.lora_left_out) == 8 and len(report.lora_folded) == 9
    state = torch.load(source, weights_only=True)["state_dict"]
    state["visual.extra"] = torch.ones(1)
    buffer = io.BytesIO()
    torch.save({"state_dict": state}, buffer)
    (tmp_path / "y.pth").write_bytes(buffer.getvalue())
    with pytest.raises(ConversionError, match="unknown parameter"):
        convert_pacs(tmp_path / "y.pth", tmp_path / "out2", "vit-b-32", str(bpe))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConversionError, match="not empty"):
            convert_pacs(source, tmp_path / "out", "vit-b-32", str(bpe))


def test_a_backbone_given_beside_a_folder_of_another_is_refused(tiny_root):
    """With ``model`` given, the folder decides what runs: another ``backbone`` beside it changed nothing."""
    import json as _json

    from capeval_plugins.testing import tiny_checkpoint

    folder = str(tiny_checkpoint("pacs", root=tiny_root))
    recorded = _json.loads((Path(folder) / "conversion.json").read_text())["backbone"]
    other = "open_clip-vit-l-14" if recorded != "open_clip-vit-l-14" else "vit-b-32"
    images = [random_image(1, size=(40, 30))]
    assert len(capeval_plugins.load("pacscore", model=folder, backbone=recorded)(images, ["a dog"]).scores) == 1
    with pytest.raises(ValueError, match=f"holds {recorded} weights .*not backbone='{other}'"):
        capeval_plugins.load("pacscore", model=folder, backbone=other)(images, ["a dog"])
