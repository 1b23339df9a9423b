"""The user's own ids: ``capeval score`` keeps every input ``id`` in its output rows, and reads predictions and
references from two files joined by id (the layout of captioning toolkits), refusing in one line an id
missing on one side or given twice."""
from __future__ import annotations

import json

import pytest
from conftest import capeval_here, capeval_in_process

import capeval_plugins
from capeval_plugins.caption_ids import read_joined
from capeval_plugins.inputs import InputError

CANDS = ["a dog runs on grass", "two cats sleep", "a red car", ""]
REFS = [["a dog running on the grass", "a brown dog"], ["cats sleeping on a bed"], ["a car parked"], ["a bird"]]
IDS = ["img-7", 3, "x", 12]


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def score(args, tmp_path):
    out = tmp_path / "scores.jsonl"
    capeval_here(["score", "-m", "cider", "-o", "tokenize=false", *args, "--out", str(out), "--quiet"])
    return rows_of(out)


def expected_cider(order):
    return capeval_plugins.load("cider", tokenize=False)(None, [CANDS[i] for i in order],
                                                         [REFS[i] for i in order]).scores.tolist()


def test_caption_file_ids_are_kept_in_every_output_row(tmp_path):
    captions = tmp_path / "caps.jsonl"
    lines = [{"id": i, "caption": c, "references": r} for i, c, r in zip(IDS, CANDS, REFS)]
    del lines[2]["id"]  # a row without an id keeps its place (null), the others keep theirs
    captions.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = score(["--captions", str(captions)], tmp_path)
    assert [r["id"] for r in rows] == ["img-7", 3, None, 12]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert [r["cider"] for r in rows] == pytest.approx(expected_cider(range(4)), rel=1e-12)


def test_a_file_without_ids_has_no_id_column(tmp_path):
    captions = tmp_path / "caps.jsonl"
    captions.write_text("".join(json.dumps({"caption": c, "references": r}) + "\n" for c, r in zip(CANDS, REFS)))
    assert "id" not in score(["--captions", str(captions)], tmp_path)[0]


def test_csv_ids_are_kept_as_written(tmp_path):
    captions = tmp_path / "caps.csv"
    captions.write_text('id,caption,references\na1,a dog,"[""a dog""]"\nb2,a cat,"[""a cat""]"\n')
    assert [r["id"] for r in score(["--captions", str(captions)], tmp_path)] == ["a1", "b2"]


@pytest.mark.parametrize("bad", [True, 1.5, [1], {"a": 1}])
def test_an_id_that_is_not_text_or_an_integer_is_refused_by_its_line(tmp_path, bad):
    captions = tmp_path / "caps.jsonl"
    lines = [{"id": "ok", "caption": "a"}, {"id": bad, "caption": "b"}]
    captions.write_text("".join(json.dumps(r) + "\n" for r in lines))
    proc = capeval_in_process(["score", "-m", "cider", "-o", "tokenize=false", "--captions", str(captions)])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "caps.jsonl:2: id" in proc.stderr


def write_pair(tmp_path, preds, refs, pname="preds.json", rname="refs.json"):
    p, r = tmp_path / pname, tmp_path / rname
    p.write_text(preds if isinstance(preds, str) else json.dumps(preds))
    r.write_text(refs if isinstance(refs, str) else json.dumps(refs))
    return p, r


@pytest.mark.parametrize("layout", ["records", "keyed", "jsonl"])
def test_predictions_and_references_joined_by_id_in_prediction_order(tmp_path, layout):
    order = [2, 0, 3, 1]  # references in another order than the predictions
    if layout == "records":
        preds = [{"id": IDS[i], "caption": CANDS[i]} for i in range(4)]
        refs = [{"image_id": IDS[i], "references": REFS[i]} for i in order]
    elif layout == "keyed":  # object keys are text: 3 and "3" are one id
        preds = {str(IDS[i]): CANDS[i] for i in range(4)}
        refs = {str(IDS[i]): REFS[i] for i in order}
    else:
        preds = "".join(json.dumps({"id": IDS[i], "caption": CANDS[i]}) + "\n" for i in range(4))
        refs = {str(IDS[i]): {"references": REFS[i]} for i in order}
    p, r = write_pair(tmp_path, preds, refs, "preds.jsonl" if layout == "jsonl" else "preds.json")
    rows = score(["--predictions", str(p), "--references", str(r)], tmp_path)
    assert [str(row["id"]) for row in rows] == [str(i) for i in IDS]
    assert [row["caption"] for row in rows] == CANDS
    assert [row["cider"] for row in rows] == pytest.approx(expected_cider(range(4)), rel=1e-12)


def test_images_come_from_either_file_relative_to_it(tmp_path):
    p, r = write_pair(tmp_path, [{"id": 1, "caption": "a", "image": "one.png"}, {"id": 2, "caption": "b"}],
                      [{"id": 1, "references": ["x"]}, {"id": 2, "references": ["y"], "image": "two.png"}])
    records = read_joined(p, r)
    assert records.images == [str(tmp_path / "one.png"), str(tmp_path / "two.png")]
    assert records.row_ids == [1, 2] and records.references == [["x"], ["y"]]


@pytest.mark.parametrize("preds, refs, message", [
    ([{"id": 1, "caption": "a"}, {"id": 2, "caption": "b"}], [{"id": 1, "references": ["x"]}],
     "1 prediction id(s) of"),
    ([{"id": 1, "caption": "a"}], [{"id": 1, "references": ["x"]}, {"id": 9, "references": ["y"]}],
     "1 reference entry id(s) of"),
    ([{"id": 1, "caption": "a"}, {"id": "1", "caption": "b"}], [{"id": 1, "references": ["x"]}],
     "is given twice in the predictions file"),
    ([{"id": 1, "caption": "a"}], [{"id": 1, "references": ["x"]}, {"id": 1, "references": ["y"]}],
     "is given twice in the references file"),
    ([{"caption": "a"}], [{"id": 1, "references": ["x"]}], "no id"),
    ([{"id": 1, "caption": "a", "image": "a.png"}], [{"id": 1, "references": ["x"], "image": "b.png"}],
     "for the same id"),
    ([{"id": None, "caption": "a"}], [{"id": 1, "references": ["x"]}], "no id"),
    ([{"id": False, "caption": "a"}], [{"id": 1, "references": ["x"]}], "is not text or an integer"),
    ([], [{"id": 1, "references": ["x"]}], "holds no entries"),
])
def test_join_refusals_are_one_line(tmp_path, preds, refs, message):
    p, r = write_pair(tmp_path, preds, refs)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_joined(p, r)
    proc = capeval_in_process(["score", "-m", "cider", "-o", "tokenize=false", "--predictions", str(p),
                               "--references", str(r)])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("name, text", [
    ("preds.json", '{"1": "a dog runs", "2": "a cat sits", "1": "zzz"}'),  # an id keyed twice
    ("preds.json", '{\n  "1": "a dog runs",\n  "2": "a cat sits",\n  "1": "zzz"\n}\n'),  # written over lines
    ("refs.json", '{"1": ["a dog running"], "2": ["a cat sitting"], "2": ["a dog"]}'),
    ("preds.jsonl", '{"id": 1, "caption": "a dog runs", "caption": "zzz"}\n{"id": 2, "caption": "a cat sits"}\n'),
])
def test_a_key_given_twice_is_refused_not_the_last_value_kept(tmp_path, name, text):
    """``json`` keeps an object's last value for a repeated key and drops the other silently: a prediction, a
    sample's references or a caption replaced, every score still printed. Each such file is refused by name."""
    paths = {"preds": tmp_path / "preds.json", "refs": tmp_path / "refs.json"}
    paths["preds"].write_text('{"1": "a dog runs", "2": "a cat sits"}', encoding="utf-8")
    paths["refs"].write_text('{"1": ["a dog running"], "2": ["a cat sitting"]}', encoding="utf-8")
    given = tmp_path / name
    given.write_text(text, encoding="utf-8")
    paths["refs" if name.startswith("refs") else "preds"] = given
    with pytest.raises(InputError, match=f"{given.name}.*given twice in one object"):
        read_joined(paths["preds"], paths["refs"])
    proc = capeval_in_process(["score", "-m", "cider", "-o", "tokenize=false", "--predictions", str(paths["preds"]),
                               "--references", str(paths["refs"])])
    assert proc.returncode == 2 and "given twice in one object" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_caption_file_row_naming_a_key_twice_is_refused_by_its_line(tmp_path):
    captions = tmp_path / "captions.jsonl"
    captions.write_text('{"caption": "a dog", "references": ["a dog runs"]}\n'
                        '{"caption": "a cat", "caption": "zzz", "references": ["a cat sits"]}\n', encoding="utf-8")
    proc = capeval_in_process(["score", "-m", "cider", "-o", "tokenize=false", "--captions", str(captions)])
    assert proc.returncode == 2 and f"{captions}:2:" in proc.stderr and '"caption" is given twice' in proc.stderr


def test_predictions_need_exactly_one_references_file_and_no_other_input(tmp_path):
    p, r = write_pair(tmp_path, [{"id": 1, "caption": "a"}], [{"id": 1, "references": ["x"]}])
    for extra in ([], ["--references", str(r), str(r)], ["--references", str(r), "--captions", str(p)]):
        proc = capeval_in_process(["score", "-m", "cider", "--predictions", str(p), *extra])
        assert proc.returncode == 2 and "--predictions" in proc.stderr, proc.stderr


def test_the_lm_eval_caption_task_keeps_the_file_s_ids(tmp_path):
    from capeval_plugins.caption_files import load_caption_docs
    from conftest import random_image

    for k in range(3):
        random_image(k).save(tmp_path / f"{k}.png")
    rows = [{"id": i, "image": f"{k}.png", "references": ["a"]} for k, i in enumerate([7, "b", None])]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = load_caption_docs(tmp_path / "docs.jsonl", tmp_path)
    assert [d["input_id"] for d in docs] == ["7", "b", None] and [d["id"] for d in docs] == [0, 1, 2]
    import datasets

    assert datasets.Dataset.from_list(docs)["input_id"] == ["7", "b", None]  # one column type for Arrow
