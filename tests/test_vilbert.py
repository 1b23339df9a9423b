"""ViLBERTScore on ViLBERT: the two-stream model, the conversion of released checkpoints and region features.

The reference is written here from the papers' and the released code's description, independently of the package:
a plain float64 forward pass straight on the released-style state dict (``bert.*`` names, one sample at a time,
no padding, the official additive -10000 masks), the official region preprocessing in numpy, and token-by-token
greedy matching (``plain_prf``)."""
from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from test_matching import plain_prf

import capeval_plugins
from capeval_plugins.commands.convert import ConversionError, convert_vilbert, read_checkpoint
from capeval_plugins.inputs import InputError

IMAGES = ["img0.jpg", "img1.png", "img2.jpg"]
CAPTIONS = ["A dog runs on the grass.", "Two children play in the park!", "A red car next to a building"]
REFERENCES = [
    ["A dog running on grass.", "A brown dog plays outside.", "A dog."],
    ["Kids playing in a park."],
    ["A car parked by a building.", "A red car.", "A vehicle on a street.", "A car.", "A building and a car."],
]


@pytest.fixture(scope="session")
def tiny_vilbert(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("vilbert", root=tiny_root))


@pytest.fixture(scope="session")
def tiny_vilbert_pretrained(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("vilbert_pretrained", root=tiny_root))


@pytest.fixture(scope="session")
def features(tmp_path_factory) -> str:
    """Feature files of different region counts (batches pad them), .npy dicts and one .npz."""
    from capeval_plugins.testing.vilbert import write_region_features

    folder = tmp_path_factory.mktemp("features")
    write_region_features(folder, ["img0", "img2"], boxes=(2, 9), seed=3)
    write_region_features(folder, ["img1"], boxes=5, suffix=".npz", seed=3)
    write_region_features(folder, ["COCO_val2014_000000000042", "7"], boxes=(3, 6), seed=4)
    return str(folder)


def vilbertscore(model, features, **options):
    return capeval_plugins.load("vilbertscore", model=model, features=features, **options)


# --- the independent reference ------------------------------------------------------------------------------------
def released_file(model_dir: str) -> Path:
    return next((Path(model_dir) / "released").glob("*.bin"))


def released_json(model_dir: str) -> dict:
    return json.loads(next((Path(model_dir) / "released").glob("*config.json")).read_text())


def plain_forward(sd: dict, cfg: dict, ids: list[int], feats: np.ndarray, locs: np.ndarray, task: int | None):
    """The official forward pass, one sample, float64: the text stream after every co-attention layer (the list
    ``output_all_encoded_layers`` returns) and the final text output."""
    p = {k: v.double() for k, v in sd.items()}

    def lin(x, name):
        return x @ p[f"bert.{name}.weight"].T + p[f"bert.{name}.bias"]

    def norm(x, name):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return p[f"bert.{name}.weight"] * (x - mu) / torch.sqrt(var + 1e-12) + p[f"bert.{name}.bias"]

    def gelu(x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

    def attend(q, k, v, heads):
        d = q.shape[-1] // heads
        split = lambda t: t.view(t.shape[0], heads, d).transpose(0, 1)  # noqa: E731
        weights = torch.softmax(split(q) @ split(k).transpose(1, 2) / math.sqrt(d), dim=-1)
        return (weights @ split(v)).transpose(0, 1).reshape(q.shape[0], -1)

    def layer(x, prefix, heads):
        a = attend(lin(x, f"{prefix}.attention.self.query"), lin(x, f"{prefix}.attention.self.key"),
                   lin(x, f"{prefix}.attention.self.value"), heads)
        x = norm(lin(a, f"{prefix}.attention.output.dense") + x, f"{prefix}.attention.output.LayerNorm")
        return norm(lin(gelu(lin(x, f"{prefix}.intermediate.dense")), f"{prefix}.output.dense") + x,
                    f"{prefix}.output.LayerNorm")

    ids_t = torch.tensor(ids)
    t = p["bert.embeddings.word_embeddings.weight"][ids_t] + p["bert.embeddings.position_embeddings.weight"][
        : len(ids)] + p["bert.embeddings.token_type_embeddings.weight"][0]
    if task is not None:
        t = torch.cat([t[:1], p["bert.embeddings.task_embeddings.weight"][task][None], t[1:]])
    t = norm(t, "embeddings.LayerNorm")
    v = norm(lin(torch.from_numpy(feats).double(), "v_embeddings.image_embeddings")
             + lin(torch.from_numpy(locs).double(), "v_embeddings.image_location_embeddings"), "v_embeddings.LayerNorm")
    outputs, t_start, v_start = [], 0, 0
    for k, (v_end, t_end) in enumerate(zip(cfg["v_biattention_id"], cfg["t_biattention_id"])):
        for i in range(t_start, t_end):
            t = layer(t, f"encoder.layer.{i}", cfg["num_attention_heads"])
        for i in range(v_start, v_end):
            v = layer(v, f"encoder.v_layer.{i}", cfg["v_num_attention_heads"])
        c, bi = f"encoder.c_layer.{k}", cfg["bi_num_attention_heads"]
        text_ctx = attend(lin(t, f"{c}.biattention.query2"), lin(v, f"{c}.biattention.key1"),
                          lin(v, f"{c}.biattention.value1"), bi)
        region_ctx = attend(lin(v, f"{c}.biattention.query1"), lin(t, f"{c}.biattention.key2"),
                            lin(t, f"{c}.biattention.value2"), bi)
        v = norm(lin(region_ctx, f"{c}.biOutput.dense1") + v, f"{c}.biOutput.LayerNorm1")
        t = norm(lin(text_ctx, f"{c}.biOutput.dense2") + t, f"{c}.biOutput.LayerNorm2")
        v = norm(lin(gelu(lin(v, f"{c}.v_intermediate.dense")), f"{c}.v_output.dense") + v, f"{c}.v_output.LayerNorm")
        t = norm(lin(gelu(lin(t, f"{c}.t_intermediate.dense")), f"{c}.t_output.dense") + t, f"{c}.t_output.LayerNorm")
        outputs.append(t)
        t_start, v_start = t_end, v_end
    for i in range(t_start, cfg["num_hidden_layers"]):
        t = layer(t, f"encoder.layer.{i}", cfg["num_attention_heads"])
    return outputs, t


def official_regions(path: str) -> tuple[np.ndarray, np.ndarray]:
    """ViLBERTScore's img_preprocess: global mean region first, then 5-d locations (the test's own files)."""
    data = np.load(path, allow_pickle=True)
    data = data.item() if path.endswith(".npy") else dict(data)
    feats = data["features"].astype(np.float32)
    boxes = data["bbox"].astype(np.float64)
    w, h = float(data["image_width"]), float(data["image_height"])
    loc = np.zeros((len(boxes), 5))
    loc[:, :4] = boxes / [w, h, w, h]
    loc[:, 4] = (boxes[:, 3] - boxes[:, 1]) * (boxes[:, 2] - boxes[:, 0]) / (w * h)
    return (np.concatenate([feats.mean(0, keepdims=True), feats]),
            np.concatenate([[[0, 0, 1, 1, 1]], loc]).astype(np.float32))


class PlainScorer:
    """Official-style scoring of one (image, candidate, references) sample at a time."""

    def __init__(self, model_dir: str, features: str, task: int | None, layer: int, final_text: bool = False):
        from transformers import BertTokenizerFast

        self.sd = torch.load(released_file(model_dir), weights_only=True)
        self.cfg = released_json(model_dir)
        self.tokenizer = BertTokenizerFast.from_pretrained(model_dir)
        self.features, self.task, self.layer, self.final_text = features, task, layer, final_text

    def tokens(self, image: str, text: str) -> list[list[float]]:
        stem = image.split(".")[0]
        path = next(str(p) for p in Path(self.features).glob(f"{stem}.np*"))
        ids = self.tokenizer(text.lower())["input_ids"]
        layers, final = plain_forward(self.sd, self.cfg, ids, *official_regions(path), self.task)
        hidden = final if self.final_text else layers[self.layer - 1]
        return hidden[1:-1].tolist()  # the task token and the word pieces; not [CLS] or [SEP]

    def score(self, image: str, candidate: str, references: list[str]) -> tuple[float, float, float]:
        cand = self.tokens(image, candidate)
        per_ref = []
        for ref in references:
            r = self.tokens(image, ref)
            per_ref.append(plain_prf(cand, r, [True] * len(cand), [True] * len(r), [1.0] * len(cand), [1.0] * len(r)))
        return tuple(sum(x[k] for x in per_ref) / len(per_ref) for k in range(3))


def prf_rows(result) -> list[tuple[float, float, float]]:
    return list(zip(result.extras["precision"].tolist(), result.extras["recall"].tolist(), result.scores.tolist()))


# --- scores ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,layer,final_text", [({}, 2, False), ({"layer": 1}, 1, False),
                                                      ({"after_text_layer": True}, 2, True)])
def test_scores_equal_a_plain_forward_and_greedy_matching(tiny_vilbert, features, options, layer, final_text):
    result = vilbertscore(tiny_vilbert, features, **options)(IMAGES, CAPTIONS, REFERENCES)
    plain = PlainScorer(tiny_vilbert, features, task=7, layer=layer, final_text=final_text)
    for got, image, caption, refs in zip(prf_rows(result), IMAGES, CAPTIONS, REFERENCES):
        assert got == pytest.approx(plain.score(image, caption, refs), abs=2e-5)


def test_pretrained_model_has_no_task_token(tiny_vilbert_pretrained, features):
    result = vilbertscore(tiny_vilbert_pretrained, features)(IMAGES, CAPTIONS, REFERENCES)
    plain = PlainScorer(tiny_vilbert_pretrained, features, task=None, layer=2)
    for got, image, caption, refs in zip(prf_rows(result), IMAGES, CAPTIONS, REFERENCES):
        assert got == pytest.approx(plain.score(image, caption, refs), abs=2e-5)
    with pytest.raises(ValueError, match="no task tokens"):
        vilbertscore(tiny_vilbert_pretrained, features, task_id=7)(IMAGES[:1], CAPTIONS[:1], REFERENCES[:1])


def test_layers_task_tokens_and_images_change_the_scores(tiny_vilbert, features):
    def scores(**options):
        return vilbertscore(tiny_vilbert, features, **options)(IMAGES, CAPTIONS, REFERENCES).scores

    last, first, other_task, no_task = scores(), scores(layer=1), scores(task_id=3), scores(task_id=-1)
    for other in (first, other_task, no_task):
        assert (last - other).abs().min() > 1e-6
    assert torch.equal(last, scores(layer=2)) and torch.equal(last, scores(task_id=7))
    swapped = vilbertscore(tiny_vilbert, features)(IMAGES[::-1], CAPTIONS, REFERENCES).scores
    assert (last - swapped).abs().max() > 1e-6  # same texts, other regions


def test_layer_zero_does_not_see_the_image(tiny_vilbert, features):
    metric = vilbertscore(tiny_vilbert, features, layer=0)
    assert torch.equal(metric(IMAGES, CAPTIONS, REFERENCES).scores,
                       metric(IMAGES[::-1], CAPTIONS, REFERENCES).scores)
    with pytest.raises(ValueError, match="layer 3 does not exist"):
        vilbertscore(tiny_vilbert, features, layer=3)(IMAGES[:1], CAPTIONS[:1], REFERENCES[:1])


def test_independent_of_batch_size_and_order(tiny_vilbert, features):
    imgs = [IMAGES[i % 3] for i in range(8)]
    caps = [CAPTIONS[i % 3] + f" {i}" for i in range(8)]
    refs = [REFERENCES[i % 3][: 1 + i % 4] for i in range(8)]
    base = vilbertscore(tiny_vilbert, features, batch_size=64)(imgs, caps, refs)
    for batch_size in (1, 3):
        other = vilbertscore(tiny_vilbert, features, batch_size=batch_size)(imgs, caps, refs)
        assert prf_rows(other) == [pytest.approx(row, abs=1e-5) for row in prf_rows(base)]
    order = list(range(8))
    random.Random(0).shuffle(order)
    shuffled = vilbertscore(tiny_vilbert, features, batch_size=4)(
        [imgs[i] for i in order], [caps[i] for i in order], [refs[i] for i in order])
    assert shuffled.scores.tolist() == pytest.approx([base.scores[i].item() for i in order], abs=1e-5)


@pytest.mark.filterwarnings("ignore:.*37-token text limit")
def test_each_image_is_embedded_once_per_batch_and_long_captions_truncated(tiny_vilbert, features, monkeypatch):
    from capeval_plugins.models.encoders.conditioned import ViLBertConditioned

    seen = []
    original = ViLBertConditioned.encode_images
    monkeypatch.setattr(ViLBertConditioned, "encode_images", lambda self, images: seen.append(len(images))
                        or original(self, images))
    long = "a dog runs on the grass " * 12
    result = vilbertscore(tiny_vilbert, features)([IMAGES[i % 3] for i in range(9)], [long] * 9, [[long]] * 9)
    assert seen == [3]
    assert result.scores.tolist() == pytest.approx([1.0] * 9, abs=1e-5)  # identical texts match themselves
    enc = vilbertscore(tiny_vilbert, features).encoder
    ids, special = enc.tokenize([long])
    assert len(ids[0]) == 37 and ids[0][-1] == enc.tokenizer.sep_token_id  # the official 37, keeping [SEP]


# --- conversion ---------------------------------------------------------------------------------------------------
def test_converted_model_equals_the_unconverted_module_and_the_plain_forward(tiny_vilbert):
    from transformers import BertTokenizerFast

    from capeval_plugins.models.encoders.vilbert import ViLBertModel
    from capeval_plugins.testing.vilbert import tiny_vilbert as build_module

    converted = ViLBertModel.from_pretrained(tiny_vilbert).eval()
    tokenizer = BertTokenizerFast.from_pretrained(tiny_vilbert)
    original, released = build_module(0, len(tokenizer))
    rng = np.random.default_rng(0)
    ids = torch.tensor([tokenizer("a dog runs on the grass")["input_ids"]])
    feats = torch.from_numpy(np.abs(rng.standard_normal((1, 6, 2048))).astype(np.float32))
    locs = torch.from_numpy(rng.uniform(0, 1, (1, 6, 5)).astype(np.float32))
    task = torch.tensor([7])
    with torch.inference_mode():
        a, b = converted(ids, feats, locs, task_ids=task), original(ids, feats, locs, task_ids=task)
    for x, y in zip([*a.coattention_text, a.text, a.regions], [*b.coattention_text, b.text, b.regions]):
        assert torch.equal(x, y)
    layers, final = plain_forward(released, released_json(tiny_vilbert), ids[0].tolist(), feats[0].numpy(),
                                  locs[0].numpy(), 7)
    assert len(a.coattention_text) == 3  # entering the first co-attention layer, then after each of the two
    for got, want in zip([*a.coattention_text[1:], a.text], [*layers, final]):
        assert torch.allclose(got[0].double(), want, atol=1e-5)


def test_conversion_reports_what_it_keeps_and_leaves_out(tiny_vilbert):
    report = json.loads((Path(tiny_vilbert) / "conversion.json").read_text())
    assert report["kept"] == len(torch.load(released_file(tiny_vilbert), weights_only=True)) - 52
    assert {k: len(v) for k, v in report["ignored"].items()} == {
        "pretraining heads (cls.*)": 14, "multi-task heads": 26, "poolers (feed only the heads)": 4,
        "co-attention q_dense1/q_dense2 (never used in the forward pass)": 8}
    assert report["task_tokens"] == 20 and report["unknown_dropped"] == []
    assert "v_target_size" in report["config_keys_ignored"]


def test_unknown_missing_and_renamed_parameters(tiny_vilbert, tmp_path):
    sd = torch.load(released_file(tiny_vilbert), weights_only=True)
    config = released_json(tiny_vilbert)
    tok = str(Path(tiny_vilbert) / "released" / "tokenizer")

    extra = {**sd, "bert.encoder.extra.weight": torch.zeros(2), "mystery_head.weight": torch.zeros(3)}
    torch.save(extra, tmp_path / "extra.bin")
    with pytest.raises(ConversionError, match=r"2 unknown parameter\(s\).*bert.encoder.extra.weight, mystery_head"):
        convert_vilbert(tmp_path / "extra.bin", tmp_path / "out1", config, tok)
    report = convert_vilbert(tmp_path / "extra.bin", tmp_path / "out1", config, tok, allow_unknown=True)
    assert report.unknown_dropped == ["bert.encoder.extra.weight", "mystery_head.weight"]

    missing = {k: v for k, v in sd.items() if k != "bert.encoder.c_layer.1.biattention.key1.weight"}
    torch.save(missing, tmp_path / "missing.bin")
    with pytest.raises(ConversionError, match=r"1 parameter\(s\) missing: encoder.c_layer.1.biattention.key1.weight"):
        convert_vilbert(tmp_path / "missing.bin", tmp_path / "out2", config, tok)

    # DataParallel prefixes and TF-style LayerNorm names load as the official loader reads them.
    renamed = {"module." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"):
               v for k, v in sd.items()}
    torch.save(renamed, tmp_path / "renamed.bin")
    convert_vilbert(tmp_path / "renamed.bin", tmp_path / "out3", config, tok)
    from safetensors.torch import load_file

    assert all(torch.equal(v, load_file(str(Path(tiny_vilbert) / "model.safetensors"))[k])
               for k, v in load_file(str(tmp_path / "out3" / "model.safetensors")).items())

    with pytest.raises(ConversionError, match="num_hidden_layers 4 in the weights but 12 in the configuration"):
        convert_vilbert(released_file(tiny_vilbert), tmp_path / "out4", None, tok)  # default: bert_base_6layer_6conect


def test_a_folder_missing_a_parameter_does_not_load(tiny_vilbert, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from capeval_plugins.models.encoders.vilbert import ViLBertModel
    from capeval_plugins.resources import loading

    folder = tmp_path / "broken"
    shutil.copytree(tiny_vilbert, folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights.pop("encoder.c_layer.0.biOutput.dense2.bias")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(loading.ModelLoadError, match="encoder.c_layer.0.biOutput.dense2.bias"):
        loading.load_model(ViLBertModel, str(folder), device="cpu", share=False)


class Payload:
    """An object a pickle would rebuild by creating a marker file (that must never happen)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_checkpoint_holding_an_arbitrary_object_is_refused(tiny_vilbert, tmp_path):
    marker = tmp_path / "was-unpickled"
    torch.save({"bert.embeddings.word_embeddings.weight": torch.zeros(2), "trap": Payload(marker)},
               tmp_path / "evil.bin")
    with pytest.raises(ConversionError, match="refused.*weights_only=True"):
        read_checkpoint(tmp_path / "evil.bin")
    assert not marker.exists()
    from capeval_plugins.cli import main

    assert main(["convert", "vilbert", str(tmp_path / "evil.bin"), str(tmp_path / "out")]) == 2
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_tokenizer_that_cannot_be_fetched_is_recorded_for_scoring_time(tiny_vilbert, tmp_path):
    report = convert_vilbert(released_file(tiny_vilbert), tmp_path / "out", released_json(tiny_vilbert),
                             tokenizer="nobody/not-cached-here")
    assert "at scoring time" in report.tokenizer
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tokenizer_source"] == "nobody/not-cached-here"
    from capeval_plugins.resources.loading import ModelLoadError

    with pytest.raises(ModelLoadError, match="word pieces but the model"):  # never an empty vocabulary at scoring time
        capeval_plugins.load("vilbertscore", model=str(tmp_path / "out")).encoder
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "dog"]) + "\n")
    with pytest.raises(ConversionError, match="7 word pieces, but the model has"):
        convert_vilbert(released_file(tiny_vilbert), tmp_path / "out2", released_json(tiny_vilbert), tokenizer=str(vocab))


# --- region-feature files -----------------------------------------------------------------------------------------
def write(path: Path, data) -> None:
    from capeval_plugins.testing.vilbert import save_region_dict

    save_region_dict(path, data)


def good_dict(n: int = 3, dim: int = 2048) -> dict:
    from capeval_plugins.testing.vilbert import fake_region_dict

    return fake_region_dict(np.random.default_rng(0), n, dim)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


BAD_FILES = {
    "missing": None,
    "garbage.npy": b"not a numpy file",
    "wrong_dim.npy": good_dict(dim=1024),
    "no_width.npz": {k: v for k, v in good_dict().items() if k != "image_width"},
    "no_boxes.npy": {k: v for k, v in good_dict().items() if k != "bbox"},
    "boxes_mismatch.npz": {**good_dict(), "bbox": np.zeros((2, 4), np.float32)},
    "array.npy": np.zeros((3, 2048), np.float32),
    "evil.npy": {**good_dict(), "trap": Evil()},
    "nan.npy": {**good_dict(), "features": np.full((3, 2048), np.nan, np.float32)},
}
MESSAGES = {"missing": "no region features for image 'missing.jpg'", "garbage.npy": "not a .npy file",
            "wrong_dim.npy": r"shape \(3, 1024\); expected \(regions, 2048\)", "no_width.npz": "no 'image_width'",
            "no_boxes.npy": "no 'bbox' or 'boxes'", "boxes_mismatch.npz": r"boxes have shape \(2, 4\)",
            "array.npy": "not a dict", "evil.npy": "refusing to unpickle",
            "nan.npy": "NaN or infinite"}


@pytest.mark.parametrize("bad", sorted(BAD_FILES))
def test_feature_file_errors_name_the_image_before_the_model_loads(tiny_vilbert, features, bad, tmp_path, monkeypatch):
    from capeval_plugins.models.encoders.vilbert import ViLBertModel

    folder = tmp_path / "features"
    folder.mkdir()
    for name in ("ok0", "ok1"):
        write(folder / f"{name}.npy", good_dict())
    stem, _, suffix = bad.partition(".")
    content = BAD_FILES[bad]
    if isinstance(content, bytes):
        (folder / bad).write_bytes(content)
    elif isinstance(content, np.ndarray):
        np.save(folder / bad, content)
    elif content is not None:
        if bad == "evil.npy":
            np.save(folder / bad, content, allow_pickle=True)
        else:
            write(folder / bad, content)

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(ViLBertModel, "from_pretrained", never)
    metric = vilbertscore(tiny_vilbert, str(folder))
    with pytest.raises(InputError, match=f"sample 1: .*{MESSAGES[bad]}") as err:
        metric(["ok0.jpg", f"{stem}.jpg", "ok1.jpg"], ["a dog"] * 3, [["a cat"]] * 3)
    assert f"'{stem}.jpg'" in str(err.value) or stem in str(err.value)


def test_region_options_are_checked(tiny_vilbert, tiny_root, features, tmp_path):
    from capeval_plugins.testing import tiny_checkpoint

    with pytest.raises(InputError, match="pass features=FOLDER"):
        capeval_plugins.load("vilbertscore", model=tiny_vilbert)(IMAGES, CAPTIONS, REFERENCES)
    with pytest.raises(InputError, match="option features: no such file or folder"):
        vilbertscore(tiny_vilbert, str(tmp_path / "nowhere"))(IMAGES, CAPTIONS, REFERENCES)
    with pytest.raises(ValueError, match="features applies to the vilbert backbone only"):
        capeval_plugins.load("vilbertscore", backbone="vilt", features=features)
    vilt = str(tiny_checkpoint("vilt", root=tiny_root))
    with pytest.raises(ValueError, match="needs a vilbert checkpoint.*capeval convert vilbert"):
        vilbertscore(vilt, features)(IMAGES, CAPTIONS, REFERENCES)
    with pytest.raises(ValueError, match="task_id applies to the vilbert backbone only"):
        capeval_plugins.load("vilbertscore", model=vilt, task_id=3)(
            [np.zeros((8, 8, 3), np.uint8)], ["a dog"], [["a cat"]])
    with pytest.raises(InputError, match="image bytes without a path"):
        vilbertscore(tiny_vilbert, features)([{"bytes": b"123", "path": None}], ["a dog"], [["a cat"]])


def test_box_locations_and_global_region():
    from capeval_plugins.resources.regions import RegionFeatures, with_global_region

    boxes = np.array([[10, 20, 50, 60], [0, 0, 100, 200]], np.float32)
    feats = np.arange(2 * 4, dtype=np.float32).reshape(2, 4)
    f, loc = with_global_region(RegionFeatures(feats, boxes, 100.0, 200.0))
    assert f.tolist() == [[2, 3, 4, 5], *feats.tolist()]
    np.testing.assert_allclose(loc, [[0, 0, 1, 1, 1], [0.1, 0.1, 0.5, 0.3, 1600 / 20000], [0, 0, 1, 1, 1]], rtol=1e-6)


# --- every ecosystem: images as ids or paths, features from the folder --------------------------------------------
ECO_IMAGES = ["COCO_val2014_000000000042", "/data/coco/val2014/COCO_val2014_000000000042.jpg", "img1.png", 7]


def test_every_ecosystem_finds_features_by_image_id_or_path(tiny_vilbert, features, tmp_path):
    import evaluate

    from capeval_plugins.adapters.lm_eval import CaptionItem, aggregate
    from capeval_plugins.pycocoevalcap import ImageResolver, ViLbertScore
    from capeval_plugins.torchmetrics import ViLBERTScore

    caps, refs = CAPTIONS + ["A man on a bench."], REFERENCES + [["An old man sits."]]
    direct = vilbertscore(tiny_vilbert, features)(ECO_IMAGES, caps, refs)
    expected = direct.scores.tolist()

    module = evaluate.load("vilbertscore", model=tiny_vilbert, features=features)
    got = module.compute(images=ECO_IMAGES, predictions=caps, references=refs)
    assert got["scores"] == pytest.approx(expected, abs=1e-6)

    tm = ViLBERTScore(model=tiny_vilbert, features=features)
    tm.update(ECO_IMAGES[:2], caps[:2], refs[:2])
    tm.update([Path(str(i)) for i in ECO_IMAGES[2:]], caps[2:], refs[2:])
    assert tm.compute_all().scores.tolist() == pytest.approx(expected, abs=1e-6)

    gts, res = {i: refs[i] for i in range(4)}, {i: [caps[i]] for i in range(4)}
    resolver = ImageResolver("/", mapping={i: str(img).lstrip("/") for i, img in enumerate(ECO_IMAGES)})
    _, by_path = ViLbertScore(resolver, model=tiny_vilbert, features=features).compute_score(gts, res)
    assert list(by_path) == pytest.approx(expected, abs=1e-6)
    ids = {img if isinstance(img, int) else Path(str(img)).name: i for i, img in enumerate(ECO_IMAGES)}
    _, by_id = ViLbertScore(model=tiny_vilbert, features=features).compute_score(
        {k: refs[i] for k, i in ids.items()}, {k: [caps[i]] for k, i in ids.items()})
    assert list(by_id) == pytest.approx([expected[i] for i in ids.values()], abs=1e-6)

    items = [CaptionItem(img, c, r) for img, c, r in zip(ECO_IMAGES, caps, refs)]
    assert aggregate("vilbertscore", items, model=tiny_vilbert, features=features) == pytest.approx(direct.score)


@pytest.mark.slow
def test_cli_scores_a_caption_file_with_a_features_folder(tiny_vilbert, features, tmp_path):
    from conftest import PYTHON, run

    lines = [{"image": f"{stem}.jpg", "caption": c, "references": r}
             for stem, c, r in zip(["img0", "img1", "img2"], CAPTIONS, REFERENCES)]
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "scores.jsonl"
    run([str(Path(PYTHON).parent / "capeval"), "score", "--metric", "vilbertscore", "--model", tiny_vilbert,
         "-o", f"features={features}", "--captions", str(captions), "--out", str(out), "--quiet"])
    expected = vilbertscore(tiny_vilbert, features)(IMAGES, CAPTIONS, REFERENCES).scores.tolist()
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [row.get("vilbertscore", row.get("score")) for row in rows] == pytest.approx(expected, abs=1e-6)
