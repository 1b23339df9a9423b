"""Regressions of ``capeval calibrate`` and ``capeval caption``.

calibrate matched ratings to samples by ``int(index)``: of two ratings of one index the last won in silence, an
index of 0.5 was truncated onto sample 0, ``"0a"`` ended in a traceback; its printed options wrote each weight
with 6 digits, so three weights of 1/3 came back as 0.333333 and Redemption Score refused them as not summing
to 1. caption stopped on an image that would not decode even under ``--on-error skip``, and under ``raise`` a
truncated image's error did not name the sample's file and line."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import capeval_in_process, random_image

import capeval_plugins
from capeval_plugins import options
from capeval_plugins.captioning import caption_and_score
from capeval_plugins.core.fusion import calibrate, fuse
from capeval_plugins.inputs import InputError
from capeval_plugins.runner import Interrupted

PARTS = ("mid", "dino", "bertscore")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _components(n, seed=0):
    rng = np.random.default_rng(seed)
    return {f"{part}_normalized": rng.random(n) for part in PARTS}


def _score_rows(comps, indices):
    return [{"index": i, **{k: float(v[p]) for k, v in comps.items()}} for p, i in enumerate(indices)]


# --- calibrate: the index that matches a rating to its sample --------------------------------------------------


@pytest.mark.parametrize("which", ["ratings", "scores"])
def test_an_index_given_twice_is_refused_naming_it_and_rows_of_distinct_indices_are_matched(tmp_path, which):
    n = 12
    comps = _components(n)
    human = fuse(np.column_stack(list(comps.values())), [0.5, 0.2, 0.3])
    order = np.random.default_rng(1).permutation(n)
    scores = _score_rows(comps, range(n))
    ratings = [{"index": int(i), "human": float(human[i])} for i in order]
    args = ["calibrate", "--scores", tmp_path / "scores.jsonl", "--ratings", tmp_path / "ratings.jsonl", "--compact"]
    repeated = {"ratings": ratings + [{"index": int(order[2]), "human": 0.0}],
                "scores": scores + [{**scores[order[2]], "mid_normalized": 0.0}]}[which]
    _write_jsonl(tmp_path / "scores.jsonl", repeated if which == "scores" else scores)
    _write_jsonl(tmp_path / "ratings.jsonl", repeated if which == "ratings" else ratings)
    proc = capeval_in_process(args)
    rows = f"rows {3 if which == 'ratings' else order[2] + 1}, {n + 1}"
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert f"{which}.jsonl: index {order[2]} is given twice ({rows})" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1

    # each index once: every rating meets its own sample, as a plain alignment by index says
    _write_jsonl(tmp_path / "scores.jsonl", scores)
    _write_jsonl(tmp_path / "ratings.jsonl", ratings)
    proc = capeval_in_process(args)
    aligned = [dict((r["index"], r["human"]) for r in ratings)[i] for i in range(n)]
    expected = calibrate(comps, aligned)
    assert proc.returncode == 0 and json.loads(proc.stdout)["correlation"] == pytest.approx(expected.correlation)
    assert json.loads(proc.stdout)["weights"] == expected.weights


@pytest.mark.parametrize("which", ["ratings", "scores"])
@pytest.mark.parametrize("index, shown", [(0.5, "index 0.5"), ("0a", 'index "0a"'), (True, "index true"),
                                          (-1, "index -1"), ("1", 'index "1"'), (None, "has no 'index'")])
def test_an_index_that_is_no_sample_index_is_refused_in_one_line_naming_its_row(tmp_path, which, index, shown):
    """0.5 was truncated onto sample 0, ``true`` read as 1, "0a" a ValueError traceback; a quoted "1" in JSON
    Lines is text, as calibrate says of a quoted component; a row without an index among rows with one fell back
    to line order."""
    n = 6
    comps = _components(n)
    scores = _score_rows(comps, range(n))
    ratings = [{"index": i, "human": float(h)} for i, h in enumerate(np.random.default_rng(2).random(n))]
    bad = scores if which == "scores" else ratings
    bad[1] = {**bad[1], "index": index} if index is not None else {k: v for k, v in bad[1].items() if k != "index"}
    _write_jsonl(tmp_path / "scores.jsonl", scores)
    _write_jsonl(tmp_path / "ratings.jsonl", ratings)
    proc = capeval_in_process(["calibrate", "--scores", tmp_path / "scores.jsonl", "--ratings",
                               tmp_path / "ratings.jsonl"])
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert f"{which}.jsonl: row 2" in proc.stderr and shown in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_csv_digits_and_integral_floats_are_indices(tmp_path, capsys):
    """What files write for integers (a CSV cell's digits, pandas' 3.0) still matches, refusals aside; and a
    CSV cell that is not digits is refused by its row rather than read as 0."""
    n = 8
    comps = _components(n, seed=3)
    human = np.random.default_rng(4).random(n)
    _write_jsonl(tmp_path / "scores.jsonl", _score_rows(comps, [float(i) for i in range(n)]))
    order = [3, 0, 7, 1, 6, 2, 5, 4]
    (tmp_path / "ratings.csv").write_text("index,human\n" + "".join(f"{i},{float(human[i])!r}\n" for i in order))
    proc = capeval_in_process(["calibrate", "--scores", tmp_path / "scores.jsonl", "--ratings",
                               tmp_path / "ratings.csv", "--step", "0.1"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["weights"] == calibrate(comps, human, step=0.1).weights
    (tmp_path / "ratings.csv").write_text("index,human\n" + "".join(f"{i}.5,{float(human[i])!r}\n" for i in order))
    proc = capeval_in_process(["calibrate", "--scores", tmp_path / "scores.jsonl", "--ratings",
                               tmp_path / "ratings.csv", "--step", "0.1"])
    assert proc.returncode == 2 and 'ratings.csv: row 1: index "3.5" is not a sample index' in proc.stderr


# --- calibrate: options that the metric takes back --------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "redemption_score."])
@pytest.mark.parametrize("step, truth", [("0.3333333333333333", (1, 1, 1)), ("0.16666666666666666", (1, 1, 4)),
                                         ("0.14285714285714285", (1, 2, 4))])
def test_the_printed_options_are_accepted_back_by_redemption_score_exactly(tmp_path, prefix, step, truth):
    """The weights of an exact mix come back; the options, built into the metric by the very parser and checks
    ``capeval score -o`` uses, give it exactly the printed weights (at 1/3 each, 0.333333 summed to 0.999999,
    which the metric refused)."""
    n = 60
    comps = _components(n, seed=5)
    units = round(1 / float(step))
    truth = np.array(truth) / units
    human = fuse(np.column_stack(list(comps.values())), truth)
    rows = [{**{f"{prefix}{k}": v for k, v in row.items()}, "human": float(h)}
            for row, h in zip(_score_rows(comps, range(n)), human)]
    _write_jsonl(tmp_path / "scores.jsonl", rows)
    proc = capeval_in_process(["calibrate", "--scores", tmp_path / "scores.jsonl", "--step", step, "--compact"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    weights = [report["weights"][f"{prefix}{part}_normalized"] for part in PARTS]
    assert weights == pytest.approx(truth.tolist(), abs=1e-9)
    assert report["options"] == [f"{prefix}{part}_weight={w!r}" for part, w in zip(PARTS, weights)]
    metric = options.build_metrics(["redemption_score"], report["options"])["redemption_score"]
    assert [getattr(metric.config, f"{part}_weight") for part in PARTS] == weights  # bit for bit


# --- caption: an image that would not decode ---------------------------------------------------------------------


def _unreadable(tmp_path, kind):
    """An image file that is no image (its header does not decode), or a PNG cut in half (its header decodes,
    its pixels do not: found only when it is loaded)."""
    path = tmp_path / f"bad-{kind}.png"
    if kind == "no image":
        path.write_bytes(b"not an image at all\n")
    else:
        random_image(9).save(tmp_path / "whole.png")
        data = (tmp_path / "whole.png").read_bytes()
        path.write_bytes(data[:len(data) // 2])
    return str(path)


def _predict(seen):
    def predict(images):
        seen.extend(images)
        return [f"a photo {im.size[0]} wide {int(np.asarray(im).sum()) % 5}" for im in images]

    return predict


REFS = [["a photo 40 wide 1"], ["a photo 44 wide 2"], ["a dog"], ["a photo 48 wide 0"], ["a cat"], ["a car"]]


def cider():
    return capeval_plugins.load("cider", tokenize=False)


@pytest.mark.parametrize("kind", ["no image", "truncated"])
def test_caption_skip_leaves_out_an_unreadable_image_and_scores_the_others_as_alone(tmp_path, kind):
    photos = [random_image(k, size=(40 + 4 * k, 36)) for k in range(4)]
    bad = _unreadable(tmp_path, kind)
    images = [photos[0], photos[1], bad, photos[2], bad, photos[3]]  # the bad image given twice
    seen = []
    done = caption_and_score(images, {"cider": cider()}, _predict(seen), REFS, batch_size=2, on_error="skip")
    good = [0, 1, 3, 5]
    alone = [f"a photo {im.size[0]} wide {int(np.asarray(im).sum()) % 5}" for im in photos]
    assert done.captions == [alone[0], alone[1], None, alone[2], None, alone[3]]
    assert len(seen) == 4  # the bad image never reached the captioner
    result = done.results["cider"]
    expected = cider()(None, alone, [REFS[i] for i in good])  # CIDEr's idf: of the captioned rows alone
    assert result.score == pytest.approx(expected.score, rel=1e-12)
    assert result.scores[good].tolist() == pytest.approx(expected.scores.tolist(), rel=1e-12)
    assert np.isnan(np.asarray(result.scores)[[2, 4]]).all() and sorted(result.skipped) == [2, 4]
    assert all(f"cannot read image {bad}" in reason for reason in result.skipped.values())
    assert result.corpus_extras["n_skipped"] == 2

    with pytest.raises(InputError, match=r"^sample 2: cannot read image .*bad-") as err:
        caption_and_score(images, {"cider": cider()}, _predict([]), REFS, batch_size=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["no image", "truncated"])
def test_capeval_caption_skips_an_unreadable_image_by_its_row_and_raise_names_its_file_and_line(tmp_path, kind):
    folder = tmp_path / "imgs"
    folder.mkdir()
    photos = [random_image(k, size=(40 + 4 * k, 36)) for k in range(3)]
    for k, im in enumerate(photos):
        im.save(folder / f"im{k}.png")
    (folder / "bad.png").write_bytes(open(_unreadable(tmp_path, kind), "rb").read())
    names = ["im0.png", "bad.png", "im1.png", "im2.png"]
    (tmp_path / "refs.jsonl").write_text("".join(json.dumps({"image": name, "references": REFS[k]}) + "\n"
                                                 for k, name in enumerate(names)))
    (tmp_path / "mycap.py").write_text("import numpy as np\ndef predict(images):\n"
                                       "    return [f'a photo {im.size[0]} wide {int(np.asarray(im).sum()) % 5}' "
                                       "for im in images]\n")
    out = tmp_path / "scores.jsonl"
    args = ["caption", "--predict", f"{tmp_path / 'mycap.py'}:predict", "--images", folder, "--references",
            tmp_path / "refs.jsonl", "-m", "cider", "-o", "tokenize=false", "--caption-batch-size", "2", "--quiet"]
    proc = capeval_in_process([*args, "--on-error", "skip", "--out", out])
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    alone = [f"a photo {im.size[0]} wide {int(np.asarray(im).sum()) % 5}" for im in photos]
    assert [r["caption"] for r in rows] == [alone[0], None, alone[1], alone[2]]
    expected = cider()(None, alone, [REFS[k] for k in (0, 2, 3)]).scores.tolist()
    assert [rows[k]["cider"] for k in (0, 2, 3)] == pytest.approx(expected, rel=1e-12)
    assert rows[1]["cider"] is None and "cannot read image" in rows[1]["error"] and "bad.png" in rows[1]["error"]
    assert [("error" in r) for r in rows] == [False, True, False, False]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["n_skipped"] == 1 and summary["metrics"]["cider"]["n_skipped"] == 1

    proc = capeval_in_process(args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "sample 1 (refs.jsonl line 2): cannot read image" in proc.stderr and "bad.png" in proc.stderr


class StopAfter:
    def __init__(self, n, seen):
        self.n, self.seen = n, seen

    def __call__(self):
        return len(self.seen) >= self.n


@pytest.mark.parametrize("batch_size, stop_after, done_before, batches", [(2, 1, 1, 3), (1, 2, 3, 5)])
def test_a_skipped_image_is_kept_skipped_when_captioning_resumes(tmp_path, batch_size, stop_after, done_before,
                                                                 batches):
    """The skip is saved with its caption batch (with one image a batch, a batch of nothing captioned): the
    resumed run ends as an uninterrupted one; resumed under raise, the skipped sample is refused by name rather
    than scored without it."""
    photos = [random_image(k, size=(40 + 4 * k, 36)) for k in range(4)]
    bad = _unreadable(tmp_path, "truncated")
    images = [photos[0], bad, photos[1], photos[2], photos[3], photos[0]]
    run = dict(batch_size=batch_size, on_error="skip")
    whole = caption_and_score(images, {"cider": cider()}, _predict([]), REFS, **run)
    seen = []
    run_dir = tmp_path / "run"
    with pytest.raises(Interrupted, match=f"after captioning {done_before} of {batches} batches"):
        caption_and_score(images, {"cider": cider()}, _predict(seen), REFS, **run, run_dir=run_dir,
                          stop=StopAfter(stop_after, seen))
    assert len(seen) == stop_after  # the bad image, among them, was skipped
    with pytest.raises(InputError, match=r"^sample 1: cannot read image .*bad-truncated.png"):
        caption_and_score(images, {"cider": cider()}, _predict(seen), REFS, batch_size=batch_size, run_dir=run_dir)
    resumed = caption_and_score(images, {"cider": cider()}, _predict(seen), REFS, **run, run_dir=run_dir)
    assert len(seen) == 4 and (resumed.batches_captioned, resumed.batches_resumed) == (batches - done_before,
                                                                                       done_before)
    assert resumed.captions == whole.captions and resumed.captions[1] is None
    assert resumed.results["cider"].scores.tolist() == pytest.approx(whole.results["cider"].scores.tolist(),
                                                                     rel=0, abs=0, nan_ok=True)
    assert resumed.results["cider"].skipped == whole.results["cider"].skipped
