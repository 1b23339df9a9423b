"""Regressions of ``capeval bench`` and ``capeval reproduce`` around score files and extras: a smoke pass reads a
row-keyed score file of the whole benchmark, a bad score file is the user's error (exit 2) before anything runs,
extras are rows only when asked and the same from the cache, the JSON report is strict JSON, and a row-keyed
file may name its images as a file without rows may."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import BENCHDATA, cli, one_line, words_metric
from scipy.stats import kendalltau
from test_reproduce import flickr_file

from capeval_plugins.bench import Captions, Ratings, run_benchmark
from capeval_plugins.bench.scorefiles import match_score_file
from capeval_plugins.inputs import InputError

EXPERT = BENCHDATA / "flickr8k_expert" / "flickr8k.json"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def tau_c(scores, human) -> float:
    return 100 * kendalltau(scores, human, variant="c").statistic


def write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_scores(tmp_path: Path, data: Path, scores: dict[str, float], capsys) -> Path:
    """What ``capeval bench --save-scores`` writes (row-keyed) for scores keyed by image and caption."""
    keyed = write_lines(tmp_path / "keyed.jsonl", [{"image": f"{c.split()[1]}.jpg", "caption": c, "score": s}
                                                   for c, s in scores.items()])
    code, _, err = cli(["bench", "flickr8k-expert", "--data", data, "--scores", f"w={keyed}", "--save-scores",
                        tmp_path / "saved", "--bootstrap", "0", "--quiet"], capsys)
    assert code == 0, err
    return tmp_path / "saved" / "w.jsonl"


def reproduce_args(data: Path, scores: Path, out: Path) -> list:
    return ["reproduce", "--metric", "fleur", "--benchmark", "flickr8k-expert", "--data", f"flickr8k-expert={data}",
            "--scores", f"fleur:flickr8k-expert={scores}", "--no-cache", "--quiet", "--json", out]


# ------------------------------------------------------------------ reproduce --limit with a row-keyed file

def test_a_smoke_pass_reads_a_row_keyed_file_of_the_whole_benchmark(offline_cache, capsys, tmp_path):
    """``--limit N`` with what ``--save-scores`` writes: rows past N are left out, and the figure is scipy's on
    the first N rows; without --limit (capeval bench) a row past the benchmark is still refused."""
    data = tmp_path / "flickr8k.json"
    captions, ratings = flickr_file(data)
    score = {c: float((k * 7) % 5) for k, c in enumerate(dict.fromkeys(captions))}
    saved = save_scores(tmp_path, data, score, capsys)
    assert len(saved.read_text().splitlines()) == len(captions) > 12
    out = tmp_path / "out.json"
    code, _, err = cli([*reproduce_args(data, saved, out), "--limit", "12"], capsys)
    assert code == 0, err
    fleur = next(r for r in json.loads(out.read_text())["rows"] if r["entry"] == "fleur")
    assert fleur["status"] == "smoke pass (--limit 12), not compared", fleur
    assert fleur["measured"] == pytest.approx(tau_c([score[c] for c in captions[:12]], ratings[:12]), abs=1e-4)

    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    past = write_lines(tmp_path / "past.jsonl", [*lines, {**lines[0], "row": len(lines)}])
    code, _, err = cli(["bench", "flickr8k-expert", "--data", data, "--scores", f"w={past}", "--quiet"], capsys)
    assert code == 2 and one_line(err) and f"row {len(lines)} is outside the benchmark's" in err


def test_a_smoke_pass_still_checks_the_rows_it_scores(tmp_path):
    """The first 4 rows of a 6-row benchmark (what reproduce's head() gives): a row it keeps must still be the
    file's image and caption, and a row past the whole benchmark or negative is refused."""
    from capeval_plugins.bench.reproduce import head

    whole = Ratings(Captions([f"{i}.jpg" for i in range(6)], list("abcdef")), np.arange(6.0))
    data = head(whole, 4)
    assert data.notes["first_rows_of"] == 6 and head(data, 2).notes["first_rows_of"] == 6
    rows = [{"row": i, "image": f"{i}.jpg", "caption": "abcdef"[i], "score": float(i)} for i in range(6)]
    assert match_score_file(write_lines(tmp_path / "ok.jsonl", rows), data).scores.tolist() == [0, 1, 2, 3]
    swapped = [{**rows[0], "row": 1}, {**rows[1], "row": 0}, *rows[2:]]
    with pytest.raises(InputError, match="benchmark row 1 is image '1.jpg', caption 'b', not '0.jpg', 'a'"):
        match_score_file(write_lines(tmp_path / "swapped.jsonl", swapped), data)
    for past in (-1, 6):
        with pytest.raises(InputError, match=f"row {past} is outside the benchmark's 6 rows"):
            match_score_file(write_lines(tmp_path / "past.jsonl", [*rows, {**rows[0], "row": past}]), data)
    first_four = Ratings(Captions([f"{i}.jpg" for i in range(4)], list("abcd")), np.arange(4.0))
    with pytest.raises(InputError, match="row 4 is outside the benchmark's 4 rows"):  # not a cut: refused
        match_score_file(tmp_path / "ok.jsonl", first_four)


@pytest.mark.skipif(not EXPERT.is_file(), reason=f"Flickr8k-Expert is not at {EXPERT}")
def test_the_auditors_smoke_pass_on_flickr8k_expert(offline_cache, capsys, tmp_path):
    """The real file: a row-keyed score of every one of its 16,992 rows, ``--limit 50``."""
    from capeval_plugins.bench import get_benchmark
    from capeval_plugins.bench.scorefiles import write_scores

    data = get_benchmark("flickr8k-expert").read(EXPERT)
    words = np.array([float(len(c.split())) for c in data.captions.candidates])
    saved = write_scores(tmp_path / "words.jsonl", data, words)
    out = tmp_path / "out.json"
    code, _, err = cli([*reproduce_args(EXPERT, saved, out), "--limit", "50"], capsys)
    assert code == 0, err
    fleur = next(r for r in json.loads(out.read_text())["rows"] if r["entry"] == "fleur")
    assert fleur["measured"] == pytest.approx(tau_c(words[:50], data.human[:50]), abs=1e-4)


# ------------------------------------------------------------------ reproduce: a bad score file is refused

@pytest.mark.parametrize("damage", ["rows missing", "another benchmark's captions"])
def test_a_bad_score_file_is_refused_before_anything_runs(offline_cache, capsys, tmp_path, damage):
    """As capeval bench refuses it: one line, exit 2, nothing printed nor written; never 'not runnable here'."""
    data = tmp_path / "flickr8k.json"
    captions, _ = flickr_file(data)
    saved = save_scores(tmp_path, data, {c: 1.0 + len(c) for c in captions}, capsys)
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    if damage == "rows missing":
        lines = lines[:-5]
    else:
        lines[3]["caption"] = "a caption of another benchmark"
    bad = write_lines(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "out.json"
    bench_code, _, bench_err = cli(["bench", "flickr8k-expert", "--data", data, "--scores", f"w={bad}", "--quiet"],
                                   capsys)
    code, stdout, err = cli(reproduce_args(data, bad, out), capsys)
    assert code == bench_code == 2 and one_line(err) and err == bench_err
    assert stdout == "" and not out.exists()


# ------------------------------------------------------------------ extras: rows only when asked, cache-proof

Length = words_metric()  # words per caption, characters as its extra


def ratings(n: int = 40) -> Ratings:
    rng = np.random.default_rng(5)
    words = "a dog cat man runs sits on grass red ball".split()
    cands = [" ".join(rng.choice(words, rng.integers(1, 8))) for _ in range(n)]
    human = np.array([len(c) for c in cands]) + rng.integers(0, 9, n)
    return Ratings(Captions([f"{i % 9}.jpg" for i in range(n)], cands), human / human.max())


def test_extras_are_rows_only_when_asked_and_the_same_from_the_cache(tmp_path):
    """Fresh, fully cached, and with one sample new: no extra row (nor saved column) without ``extras``; with it,
    the ``length:chars`` row is scipy's on every row each time."""
    data = ratings()
    cache = tmp_path / "scores.sqlite"
    changed = Ratings(Captions(data.captions.images, ["one new caption", *data.captions.candidates[1:]]), data.human)
    for k, rows in enumerate((data, data, changed)):
        saved = tmp_path / f"saved{k}"
        plain = run_benchmark("nebula", rows, {"length": Length()}, cache=cache, bootstrap=0, progress=False,
                              save_scores=saved).to_dict()["results"]
        assert list(plain) == ["length"], k
        assert set(json.loads((saved / "length.jsonl").read_text().splitlines()[0])) == {"row", "image", "caption",
                                                                                          "score"}
        asked = run_benchmark("nebula", rows, {"length": Length()}, cache=cache, bootstrap=0, progress=False,
                              extras=True).to_dict()["results"]
        chars = [float(len(c)) for c in rows.captions.candidates]
        assert asked["length:chars"]["n"] == len(chars) and "n_invalid" not in asked["length:chars"], k
        assert asked["length:chars"]["kendall_tau_c"] == pytest.approx(tau_c(chars, rows.human), abs=1e-9), k


def test_the_json_report_writes_null_for_a_figure_without_a_value(offline_cache, capsys, tmp_path):
    """A constant score has no correlation: null in the --json file (strict JSON), as the CI column already is."""
    data = tmp_path / "nebula.json"
    data.write_text(json.dumps([{"imgid": f"{i:04d}", "mt": f"caption {i}", "refs": ["a reference"],
                                 "score": i / 10} for i in range(8)]))
    constant = write_lines(tmp_path / "constant.jsonl", [{"row": i, "score": 1.0} for i in range(8)])
    out = tmp_path / "out.json"
    code, _, err = cli(["bench", "nebula", "--data", data, "--scores", f"c={constant}", "--bootstrap", "0", "--json",
                        out, "--quiet"], capsys)
    assert code == 0, err

    def refuse(name):
        raise AssertionError(f"{name} in the --json file")

    result = json.loads(out.read_text(), parse_constant=refuse)["results"]["c"]
    assert result["kendall_tau_c"] is None and result["pearson"] is None and result["n"] == 8
    assert math.isnan(tau_c([1.0] * 8, range(8)))  # scipy has none either


# ------------------------------------------------------------------ row-keyed files: the image's name forms

@pytest.mark.parametrize("name", [lambda i: f"/home/me/{i}.jpg", lambda i: f"{i}.jpg", lambda i: str(i)],
                         ids=["absolute path", "file name", "without suffix"])
def test_a_row_keyed_file_may_name_the_image_as_a_keyed_file_may(tmp_path, name):
    """``image`` as its file name alone or without suffix is accepted with ``row``, as without; the figure is
    scipy's; a name of another image is still refused."""
    n = 12
    data = Ratings(Captions([f"Flicker8k_Dataset/{i}.jpg" for i in range(n)], [f"caption {i}" for i in range(n)]),
                   np.linspace(0, 1, n)[::-1].copy())
    scores = [float((i * 5) % 7) for i in range(n)]
    rows = [{"row": i, "image": name(i), "caption": f"caption {i}", "score": s} for i, s in enumerate(scores)]
    report = run_benchmark("nebula", data, scores={"s": write_lines(tmp_path / "s.jsonl", rows)}, bootstrap=0,
                           progress=False).to_dict()["results"]["s"]
    assert report["scores_matched_by"] == "row"
    assert report["kendall_tau_c"] == pytest.approx(tau_c(scores, data.human), abs=1e-9)
    rows[4]["image"] = name(5)
    with pytest.raises(InputError, match="benchmark row 4 is image 'Flicker8k_Dataset/4.jpg'"):
        match_score_file(write_lines(tmp_path / "wrong.jsonl", rows), data)


def test_a_row_keyed_file_with_an_image_but_no_caption_is_checked(tmp_path):
    """'image and caption are checked where the file has them': an image alone is checked too."""
    data = Ratings(Captions(["a/0.jpg", "a/1.jpg"], ["x", "y"]), np.array([0.0, 1.0]))
    rows = [{"row": 0, "image": "1.jpg", "score": 1.0}, {"row": 1, "image": "0.jpg", "score": 2.0}]
    with pytest.raises(InputError, match="benchmark row 0 is image 'a/0.jpg', caption 'x', not '1.jpg', 'x'"):
        match_score_file(write_lines(tmp_path / "swapped.jsonl", rows), data)
