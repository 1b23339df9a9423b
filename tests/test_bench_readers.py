"""Benchmark readers: row counts on the real files (skipped where ../shared/benchdata is absent) and every
published layout on small files written here, checked against plain loops over the same files."""
from __future__ import annotations

import csv
import json
from collections import Counter

import numpy as np
import pytest
from conftest import BENCHDATA, random_image

from capeval_plugins.bench import get_benchmark, load_benchmark
from capeval_plugins.bench.data import Pairs, Ratings, clean, resolve_images
from capeval_plugins.inputs import InputError

real = pytest.mark.skipif(not BENCHDATA.is_dir(), reason="../shared/benchdata is not on this machine")


# ------------------------------------------------------------------------------------------ real files

@real
def test_flickr8k_expert_one_row_per_expert_rating():
    path = BENCHDATA / "flickr8k_expert" / "flickr8k.json"
    data = load_benchmark("flickr8k-expert", path)
    assert isinstance(data, Ratings) and len(data.captions) == 16992 and data.excluded == 0
    raw = json.loads(path.read_text())
    norm = lambda t: " ".join(t.split())  # noqa: E731
    plain = [(j["image_path"], norm(j["caption"]), j["rating"], [norm(r) for r in v["ground_truth"]])
             for v in raw.values() for j in v["human_judgement"]]
    c = data.captions
    assert list(zip(c.images, c.candidates, data.human.tolist(), c.references)) == plain
    pairs = Counter(zip(data.captions.images, data.captions.candidates))
    assert len(pairs) == 5664 and set(pairs.values()) == {3}  # 5,664 captions x 3 experts, not averaged
    assert len(set(data.captions.images)) == 1000 and set(data.human.tolist()) <= {1.0, 2.0, 3.0, 4.0}
    assert all(c not in refs for c, refs in zip(data.captions.candidates, data.captions.references))


@real
def test_pascal50s_has_four_categories_of_1000_pairs():
    data = load_benchmark("pascal50s", BENCHDATA / "pascal50s" / "pascal_50s.json")
    assert isinstance(data, Pairs) and len(data) == 4000 and len(data.captions) == 8000
    assert Counter(data.categories) == {"HC": 1000, "HI": 1000, "HM": 1000, "MM": 1000}
    raw = json.loads((BENCHDATA / "pascal50s" / "pascal_50s.json").read_text())
    plain = [(cat, clean(p["captions"][0]), clean(p["captions"][1]), p["label"]) for cat, ps in raw.items() for p in ps]
    got = [(cat, data.captions.candidates[a], data.captions.candidates[b], int(lab))
           for cat, a, b, lab in zip(data.categories, data.first, data.second, data.label)]
    assert got == plain and all(len(r) == 5 for r in data.captions.references)


@real
def test_nebula_and_thumb_row_counts():
    nebula = load_benchmark("nebula", BENCHDATA / "nebula" / "nebula_test.json")
    assert len(nebula.captions) == 3298 and ((nebula.human >= 0) & (nebula.human <= 1)).all()
    assert all(5 <= len(r) <= 10 for r in nebula.captions.references)
    thumb = load_benchmark("thumb", BENCHDATA / "thumb")
    assert len(thumb.captions) == 2500 and len(set(thumb.captions.images)) == 500
    assert all(len(r) == 4 for r in thumb.captions.references)
    from_file = load_benchmark("thumb", BENCHDATA / "thumb" / "mscoco_THumB-1.0.jsonl")
    assert from_file.human.tolist() == thumb.human.tolist()


# ------------------------------------------------------------------------------------ Flickr8k layouts

def read_unchecked(benchmark, path):
    """The benchmark's reader alone: these files mix the scales of Expert (1-4) and CF (0-1) ratings, which
    ``load_benchmark`` checks (see test_hostile_benchmark_values)."""
    return get_benchmark(benchmark).reader(path)


def judgement_json(tmp_path, name="f.json"):
    data = {
        "img1": {"ground_truth": ["A dog runs .", "A brown  dog on grass .", "Dog outside"],
                 "human_judgement": [
                     {"image_path": "Flickr8k_Dataset/img1.jpg", "caption": "A dog runs .", "rating": 4.0},
                     {"image_path": "Flickr8k_Dataset/img1.jpg", "caption": "A  brown dog on grass .", "rating": 3.0},
                     {"image_path": "Flickr8k_Dataset/img1.jpg", "caption": "A cat sleeps .", "rating": 1.0},
                     {"image_path": "Flickr8k_Dataset/img1.jpg", "caption": "A cat sleeps .", "rating": float("nan")}]},
        "img2": {"ground_truth": ["Two kids play ."], "image_path": "Flicker8k_Dataset/img2.jpg",
                 "human_judgement": [{"caption": "Kids in a park", "rating": 0.66}]},
    }
    path = tmp_path / name
    path.write_text(json.dumps(data))  # NaN is written as the bare NaN token, as Python's json does
    return path


def test_expert_drops_candidates_that_are_references_and_nan_ratings(tmp_path):
    data = read_unchecked("flickr8k-expert", judgement_json(tmp_path))
    assert data.captions.candidates == ["A cat sleeps .", "Kids in a park"]
    assert data.excluded == 2 and data.notes["nan_ratings"] == 1
    assert data.captions.references[0] == ["A dog runs .", "A brown dog on grass .", "Dog outside"]
    assert data.captions.images == ["Flickr8k_Dataset/img1.jpg", "Flicker8k_Dataset/img2.jpg"]


def test_cf_keeps_rows_and_removes_judged_candidates_from_references(tmp_path):
    data = read_unchecked("flickr8k-cf", judgement_json(tmp_path))
    assert len(data.captions) == 4 and data.excluded == 0
    assert data.captions.references[0] == ["Dog outside"]  # both judged references removed, image-wide
    assert data.human.tolist() == [4.0, 3.0, 1.0, 0.66]


# ------------------------------------------------------------------------------------------- Composite

def test_composite_fleur_layout_with_subsets_and_optional_references(tmp_path):
    rows = {"flickr8k": [{"image": "a.jpg", "caption": "a dog", "human": 4},
                         {"image": "a.jpg", "caption": "x", "human": 1}],
            "coco": [{"image": "b.jpg", "caption": "a  cat", "human": 2.5}]}
    (tmp_path / "c.json").write_text(json.dumps(rows))
    data = load_benchmark("composite", tmp_path / "c.json")
    assert data.captions.candidates == ["a dog", "x", "a cat"] and data.captions.references is None
    assert data.categories == ["flickr8k", "flickr8k", "coco"] and data.human.tolist() == [4, 1, 2.5]
    for subset in rows.values():
        for r in subset:
            r["refs"] = ["a dog", "something else"]
    (tmp_path / "r.json").write_text(json.dumps(rows))
    with_refs = load_benchmark("composite", tmp_path / "r.json")
    assert with_refs.captions.candidates == ["x", "a cat"] and with_refs.excluded == 1


def test_composite_reads_the_clipscore_layout_too(tmp_path):
    assert len(read_unchecked("composite", judgement_json(tmp_path)).captions) == 2


# ---------------------------------------------------------------------------------- Nebula / Polaris

POLARIS_ROWS = [
    {"mt": "A dog runs.", "refs": ["a dog", "a brown dog"], "score": 0.75, "imgid": "0001"},
    {"mt": "Two  cats", "refs": ["two cats", "cats on a sofa", "a pet"], "score": 0.25, "imgid": "0002"},
]


def test_polaris_csv_json_and_jsonl_read_the_same(tmp_path):
    with open(tmp_path / "polaris_test.csv", "w", newline="") as f:  # Polos: refs as a Python list literal
        writer = csv.DictWriter(f, fieldnames=["mt", "refs", "score", "imgid"])
        writer.writeheader()
        for row in POLARIS_ROWS:
            writer.writerow({**row, "refs": repr(row["refs"])})
    (tmp_path / "polaris_test.json").write_text(json.dumps(POLARIS_ROWS))
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in POLARIS_ROWS))
    reads = [load_benchmark("polaris", tmp_path / n) for n in ("polaris_test.csv", "polaris_test.json", "p.jsonl")]
    for data in reads:
        assert data.captions.candidates == ["A dog runs.", "Two cats"]
        assert data.captions.references == [r["refs"] for r in POLARIS_ROWS]
        assert data.human.tolist() == [0.75, 0.25] and data.captions.images == ["0001", "0002"]


def test_polaris_parquet_with_embedded_images(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"refs": [r["refs"] for r in POLARIS_ROWS], "cand": [r["mt"] for r in POLARIS_ROWS],
                      "img": [{"bytes": b"\x89PNG fake", "path": "0001.png"}, {"bytes": b"other", "path": "0002.png"}],
                      "human_score": [0.75, 0.25]})
    pq.write_table(table, tmp_path / "test.parquet")
    data = load_benchmark("polaris", tmp_path / "test.parquet")
    assert data.captions.candidates == ["A dog runs.", "Two cats"]
    assert data.captions.images[0]["bytes"] == b"\x89PNG fake"
    assert resolve_images(data.captions.images, None, "polaris") == data.captions.images  # no folder needed


def test_rows_name_the_record_that_is_wrong(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps([POLARIS_ROWS[0], {"mt": "x", "refs": ["y"], "imgid": "3"}]))
    with pytest.raises(InputError, match=r"row 1: no human score"):
        load_benchmark("nebula", tmp_path / "bad.json")
    (tmp_path / "bad2.json").write_text(json.dumps([{**POLARIS_ROWS[0], "score": "high"}]))
    with pytest.raises(InputError, match=r"row 0: human score 'high'"):
        load_benchmark("nebula", tmp_path / "bad2.json")


# ------------------------------------------------------------------------------------------------ THumB

def test_thumb_joins_references_by_segment(tmp_path):
    rows = [{"SYS": "Up-Down", "seg_id": "974", "hyp": "A group  of people.", "image": "COCO_val2014_000000000974.jpg",
             "human_score": 3.5},
            {"SYS": "Human", "seg_id": "2453", "hyp": "A bench.", "image": "COCO_val2014_000000002453.jpg",
             "human_score": 4.25}]
    (tmp_path / "mscoco_THumB-1.0.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    refs = [{"seg_id": "2453", "set_id": 24, "refs": ["r1", "r2", "r3", "r4"]},
            {"seg_id": "974", "set_id": 5, "refs": ["e1", "e2", "e3", "e4"]}]
    (tmp_path / "mscoco_references.json").write_text("\n".join(json.dumps(r) for r in refs))
    data = load_benchmark("thumb", tmp_path)
    assert data.captions.references == [["e1", "e2", "e3", "e4"], ["r1", "r2", "r3", "r4"]]
    assert data.captions.candidates == ["A group of people.", "A bench."]
    assert data.notes["systems"] == ["Human", "Up-Down"]
    (tmp_path / "mscoco_references.json").write_text(json.dumps(refs[0]))
    with pytest.raises(InputError, match="no references for seg_id 974"):
        load_benchmark("thumb", tmp_path)


# ---------------------------------------------------------------------------------------- pairwise

def test_generic_pairwise_flat_list_with_domains_and_one_reference(tmp_path):
    pairs = [{"image": "p/1.png", "caption_a": "a painting of a cat", "caption_b": "a dog", "label": 0,
              "reference": "a cat painted in oil", "domain": "painting"},
             {"image": "s/2.png", "captions": ["a sketch", "a sketch of a house"], "label": 1,
              "reference": "a pencil house", "domain": "sketch"},
             {"image": "p/3.png", "captions": ["x", "y"], "label": 1, "reference": "z", "domain": "painting"}]
    (tmp_path / "mceval.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    data = load_benchmark("mceval", tmp_path / "mceval.jsonl")
    assert len(data) == 3 and data.categories == ["painting", "painting", "sketch"]
    got = [(data.captions.candidates[a], data.captions.candidates[b], int(lab)) for a, b, lab in
           zip(data.first, data.second, data.label)]
    assert got == [("a painting of a cat", "a dog", 0), ("x", "y", 1), ("a sketch", "a sketch of a house", 1)]
    assert data.captions.references[data.first[2]] == ["a pencil house"]


def test_pairwise_errors_name_the_pair(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"HC": [{"image": "i", "captions": ["a", "b"], "label": 2}]}))
    with pytest.raises(InputError, match=r"HC\[0\]: label must be 0 or 1"):
        load_benchmark("mceval", tmp_path / "p.json")
    with pytest.raises(InputError, match=r"categories \['HI', 'HM', 'MM'\] missing"):
        load_benchmark("pascal50s", tmp_path / "p.json")


def test_foil_pairs_each_foil_with_its_original_and_excludes_it_from_references(tmp_path):
    foil = {"images": [{"id": 1, "file_name": "COCO_val2014_000000000001.jpg"}, {"id": 2, "file_name": "two.jpg"}],
            "annotations": [
                {"id": 10, "image_id": 1, "caption": "A dog on a sofa.", "foil": False},
                {"id": 10, "image_id": 1, "caption": "A cat on a sofa.", "foil": True},
                {"id": 10, "image_id": 1, "caption": "A horse on a sofa.", "foil": True},
                {"id": 11, "image_id": 2, "caption": "Two men ride bikes.", "foil": False},
                {"id": 11, "image_id": 2, "caption": "Two men ride horses.", "foil": True},
                {"id": 12, "image_id": 2, "caption": "An orphan foil.", "foil": True}]}
    coco = {"annotations": [{"image_id": 1, "caption": c} for c in ("r1", "A dog on a sofa.", "r2", "r3", "r4", "r5")]
            + [{"image_id": 2, "caption": c} for c in ("Two men ride bikes.", "s1", "s2")]}
    (tmp_path / "foilv1.0_test_2017.json").write_text(json.dumps(foil))
    (tmp_path / "captions_val2014.json").write_text(json.dumps(coco))
    data = load_benchmark("foil", tmp_path)
    assert Counter(data.categories) == {"1-ref": 3, "4-ref": 3} and data.notes["annotation_ids_skipped"] == 1
    assert (data.label == 0).all()  # the original (first) is always the preferred caption
    first_setting = [(data.captions.candidates[a], data.captions.candidates[b], tuple(data.captions.references[a]))
                     for a, b, cat in zip(data.first, data.second, data.categories) if cat == "1-ref"]
    assert first_setting == [("A dog on a sofa.", "A cat on a sofa.", ("r1",)),
                             ("A dog on a sofa.", "A horse on a sofa.", ("r1",)),
                             ("Two men ride bikes.", "Two men ride horses.", ("s1",))]
    four = [tuple(data.captions.references[a]) for a, cat in zip(data.first, data.categories) if cat == "4-ref"]
    assert four[0] == ("r1", "r2", "r3", "r4") and four[2] == ("s1", "s2")
    corpora = data.captions.corpora()
    assert len(corpora) == 2 and all(len(c) == 6 for c in corpora)
    assert load_benchmark("foil", tmp_path / "foilv1.0_test_2017.json").captions.candidates == data.captions.candidates


# -------------------------------------------------------------------------------------------- images

def test_images_resolve_by_name_file_name_or_added_suffix(tmp_path):
    (tmp_path / "img1.jpg").write_bytes(b"x")
    (tmp_path / "0002.png").write_bytes(b"x")
    got = resolve_images(["Flickr8k_Dataset/img1.jpg", "0002", "img1.jpg"], tmp_path, "b")
    assert got == [str(tmp_path / "img1.jpg"), str(tmp_path / "0002.png"), str(tmp_path / "img1.jpg")]
    with pytest.raises(InputError, match=r"row 1: image 'nope' not found \(tried .*nope\.jpg"):
        resolve_images(["img1.jpg", "nope"], tmp_path, "b")
    with pytest.raises(InputError, match="pass the image folder"):
        resolve_images(["img1.jpg"], None, "b")


def test_resampling_units_group_rows_of_one_image():
    from capeval_plugins.bench.data import Captions

    ratings = Ratings(Captions(["a", "b", "a", "c"], ["w", "x", "y", "z"]), np.array([1, 2, 3, 4]))
    units = ratings.units("image")
    assert units[0] == units[2] and len(set(units.tolist())) == 3 and ratings.units("row").tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------ values of the wrong type are refused

@pytest.mark.parametrize("benchmark, record, message", [
    # a caption that is a number or a list was turned into its repr and scored
    ("nebula", {"imgid": 1, "mt": 42, "refs": ["a dog"], "score": 0.5}, "candidate caption must be text"),
    ("nebula", {"imgid": 1, "mt": ["a", "dog"], "refs": ["a dog"], "score": 0.5}, "candidate caption must be text"),
    # true / false read as 1 / 0
    ("nebula", {"imgid": 1, "mt": "a dog", "refs": ["a dog"], "score": True}, "human score True is not a number"),
])
def test_rated_rows_refuse_values_of_the_wrong_type(tmp_path, benchmark, record, message):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([record]))
    with pytest.raises(InputError, match=f"row 0: {message}"):
        load_benchmark(benchmark, path)


@pytest.mark.parametrize("label", [True, "1", 0.5, None])
def test_pairwise_labels_must_be_the_numbers_0_or_1(tmp_path, label):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps({"HC": [{"image": "a.jpg", "captions": ["a", "b"], "label": label}]}))
    with pytest.raises(InputError, match=r"HC\[0\]: (label must be 0 or 1|no label)"):
        load_benchmark("mceval", path)
    path.write_text(json.dumps({"HC": [{"image": "a.jpg", "captions": ["a", "b"], "label": 1.0}]}))
    assert load_benchmark("mceval", path).label.tolist() == [1]  # an integral float (pandas, Parquet) is read


def test_judgement_json_refuses_a_numeric_caption_and_a_boolean_rating(tmp_path):
    path = tmp_path / "flickr8k.json"
    entry = {"ground_truth": ["a dog runs"], "human_judgement": [{"caption": 7, "rating": 3, "image_path": "x.jpg"}]}
    path.write_text(json.dumps({"1": entry}))
    with pytest.raises(InputError, match="judgement 0: caption must be text"):
        load_benchmark("flickr8k-expert", path)
    entry["human_judgement"][0].update(caption="a cat", rating=False)
    path.write_text(json.dumps({"1": entry}))
    with pytest.raises(InputError, match="judgement 0: human score False is not a number"):
        load_benchmark("flickr8k-expert", path)


def test_new_readers_refuse_mistyped_values(tmp_path):
    folder = tmp_path / "sc"
    folder.mkdir()
    item = {"filename": "a.jpg", "caption": 3, "negative_caption": "b"}
    (folder / "add_att.json").write_text(json.dumps({"0": item}))
    with pytest.raises(InputError, match="item '0': caption must be text"):
        load_benchmark("sugarcrepe", folder / "add_att.json")
    vatex = tmp_path / "vatex.json"
    vatex.write_text(json.dumps({"v": {"vid": "v", "cands": ["a"], "scores": "[[1, 2, true]]", "refs": [["r"]]}}))
    with pytest.raises(InputError, match="candidate 0: human score True is not a number"):
        load_benchmark("vatex-eval", vatex)
    vatex.write_text(json.dumps({"v": {"vid": "v", "cands": ["a", "b"], "scores": "[[1, 2, 3], [1, 2]]",
                                       "refs": [["r"]]}}))
    with pytest.raises(InputError, match="candidate 1: expected one rating per annotator"):
        load_benchmark("vatex-eval", vatex)
    arena = tmp_path / "arena.json"
    arena.write_text(json.dumps([{"img": "a.jpg", "source1": "A", "source2": "B", "caption1": "x", "caption2": None,
                                  "winner": "A", "cluster": "level 1"}]))
    with pytest.raises(InputError, match="battle 0: no caption2"):
        load_benchmark("caparena", arena)


def test_foil_flag_must_be_a_boolean(tmp_path):
    foil = {"images": [{"id": 1, "file_name": "one.jpg"}],
            "annotations": [{"id": 10, "image_id": 1, "caption": "A dog.", "foil": "false"},
                            {"id": 10, "image_id": 1, "caption": "A cat.", "foil": True}]}
    (tmp_path / "foilv1.0_test_2017.json").write_text(json.dumps(foil))
    (tmp_path / "captions_val2014.json").write_text(json.dumps({"annotations": [{"image_id": 1, "caption": "r"}]}))
    with pytest.raises(InputError, match="annotation 10: 'foil' must be true or false, got 'false'"):
        load_benchmark("foil", tmp_path)


@pytest.mark.parametrize("name", ["", ".", "  ", "./"])
def test_an_empty_image_name_names_no_file_not_the_whole_folder(tmp_path, name):
    """``images / ""`` is the images folder itself, and its files were read as one video of every image (a
    training row with ``"image": ""`` trained on it)."""
    from capeval_plugins.bench.data import _find
    from capeval_plugins.inputs import InputError

    for k in range(3):
        random_image(k).save(tmp_path / f"frame{k}.png")
    with pytest.raises(InputError, match="names no file"):
        _find(name, tmp_path, 2, "train.jsonl")
    assert _find("frame1", tmp_path, 2, "train.jsonl").endswith("frame1.png")
