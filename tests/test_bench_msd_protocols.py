"""MSD-Score's own protocols for CapArena and DOCENT (``capeval bench --protocol msd-score``), each against a plain
loop that follows its official scripts (SteinsGateSg/MSDScore caparena.py, docent.py) step by step; the
official protocols stay the default; the scripts' mixture sizes (5 image, 3 text components) on both."""
from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from conftest import capeval_here, capeval_in_process
from scipy.stats import kendalltau, pearsonr, spearmanr

from capeval_plugins.bench import load_benchmark, run_benchmark
from capeval_plugins.bench.benchmarks import get_benchmark, metric_options
from capeval_plugins.bench.data import clean

CLI = ["bench"]  # through capeval_here: cli.main in this process (no process boundary under test)
MODELS = ["GPT-4o-0806", "Gemini-2.0-flash-exp", "InternVL2-26B", "LLaVA-1.5-7B", "Qwen2-VL-2B-Instruct"]
LABELS = ["1_much_better", "1_slightly_better", "equal", "2_slightly_better", "2_much_better"]


def score(caption: str) -> float:
    """Words, plus 3e-5 per 'w': captions of equal length differ by less than 1e-4 up to three words."""
    caption = clean(caption)
    return len(caption.split()) + 3e-5 * caption.count("w")


def write_scores(path: Path, data) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, (image, caption) in enumerate(zip(data.captions.images, data.captions.candidates)):
            f.write(json.dumps({"row": i, "image": image, "caption": caption, "score": score(caption)}) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ CapArena

def caparena_items(n: int = 300) -> list[dict]:
    rng = np.random.default_rng(3)
    items = []
    for k in range(n):
        a, b = rng.choice(MODELS + ["human"], 2, replace=False).tolist()
        winner = [a, b, "tie", "tie (bothbad)"][int(rng.choice(4, p=[0.4, 0.4, 0.15, 0.05]))]
        items.append({"img": f"docci_{k % 50}.jpg", "source1": a, "source2": b,
                      "caption1": "w " * int(rng.integers(1, 6)), "caption2": "v " * int(rng.integers(1, 6)),
                      "ref": "a reference", "winner": winner, "cluster": f"level {k % 4 + 1}"})
    return items


def elo_update(ratings: dict, a: str, b: str, s_a: float, k: float = 32.0) -> None:
    e_a = 1.0 / (1.0 + 10.0 ** ((ratings[b] - ratings[a]) / 400.0))
    ratings[a], ratings[b] = ratings[a] + k * (s_a - e_a), ratings[b] + k * ((1.0 - s_a) - (1.0 - e_a))


def msd_caparena_loop(items: list[dict], eps: float = 1e-4, seed: int = 1234, rounds: int = 1) -> dict:
    """MSD-Score's caparena.py, step by step, on the word-count score (``rounds``: its --shuffle_rounds)."""
    levels: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    records = []
    for it in items:
        s1, s2, winner = it["source1"], it["source2"], it["winner"]
        human = 1 if winner == s1 else -1 if winner == s2 else 0 if winner == "tie" else None
        if human is None:
            continue
        diff = score(it["caption1"]) - score(it["caption2"])
        if human != 0:
            predicted = 1 if diff > eps else -1 if diff < -eps else 0
            levels[it["cluster"]][0] += predicted == human
            levels[it["cluster"]][1] += 1
        records.append((s1, s2, winner, diff))
    metric_sum, human_sum = defaultdict(float), defaultdict(float)
    for round_ in range(rounds):
        shuffled = list(records)
        random.Random(seed + round_).shuffle(shuffled)
        metric, human_elo = defaultdict(lambda: 1000.0), defaultdict(lambda: 1000.0)
        for s1, s2, winner, diff in shuffled:
            elo_update(metric, s1, s2, 1.0 if diff > eps else 0.0 if diff < -eps else 0.5)
            s_h = 1.0 if winner == s1 else 0.0 if winner == s2 else 0.5
            elo_update(human_elo, s1, s2, s_h)
        for m, r in metric.items():
            metric_sum[m] += r
        for m, r in human_elo.items():
            human_sum[m] += r
    metric = {m: r / rounds for m, r in metric_sum.items()}
    human_elo = {m: r / rounds for m, r in human_sum.items()}
    rank_m = [m for m, _ in sorted(metric.items(), key=lambda x: x[1], reverse=True) if m != "human"]
    rank_h = [m for m, _ in sorted(human_elo.items(), key=lambda x: x[1], reverse=True) if m != "human"]
    common = [m for m in rank_m if m in rank_h]
    b_pos = [rank_h.index(m) + 1 for m in common]
    a_pos = list(range(1, len(common) + 1))
    correct, total = sum(v[0] for v in levels.values()), sum(v[1] for v in levels.values())
    return {"accuracy": 100 * correct / total, "n": total,
            "levels": {k: 100 * v[0] / v[1] for k, v in levels.items()},
            "spearman": 100 * spearmanr(b_pos, a_pos).statistic, "kendall_tau_b": 100 * kendalltau(b_pos, a_pos).statistic,
            "models": len(common)}


def test_caparena_msd_protocol_equals_its_script_as_a_loop(tmp_path):
    items = caparena_items()
    path = tmp_path / "caparena_annots_eval.json"
    path.write_text(json.dumps(items))
    data = get_benchmark("caparena").with_protocol("msd-score").read(path)
    assert data.excluded == sum(i["winner"] not in (i["source1"], i["source2"], "tie") for i in items)
    scores = write_scores(tmp_path / "s.jsonl", data)
    out = tmp_path / "msd.json"
    capeval_here(CLI + ["caparena", "--data", str(path), "--scores", f"w={scores}", "--protocol", "msd-score",
               "--bootstrap", "10", "--json", str(out), "--quiet"])
    report = json.loads(out.read_text())
    result = report["results"]["w"]
    expected = msd_caparena_loop(items)
    assert report["protocol"]["variant"] == "msd-score" and report["protocol"]["tie_margin"] == 1e-4
    assert result["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-9)
    assert result["n"] == expected["n"]
    for level, value in expected["levels"].items():
        assert result["categories"][level]["accuracy"] == pytest.approx(value, abs=1e-9)
    assert result["system"]["n"] == expected["models"] == len(MODELS)
    assert result["system"]["spearman"] == pytest.approx(expected["spearman"], abs=1e-9)
    assert result["system"]["kendall_tau_b"] == pytest.approx(expected["kendall_tau_b"], abs=1e-9)
    # the near-ties are what the margin decides: without it the figure moves
    no_margin = run_benchmark("caparena", path, scores={"w": scores}, protocol="msd-score", tie_margin=0.0,
                              bootstrap=0, progress=False).to_dict()["results"]["w"]
    assert no_margin["accuracy"] != pytest.approx(result["accuracy"])


def test_caparena_msd_protocol_shuffle_rounds_equal_its_script(tmp_path):
    """--shuffle-rounds R: R Elo passes, round r shuffled by random.Random(1234 + r), ratings averaged, as
    caparena.py --shuffle_rounds (default 1; the README runs 5)."""
    items = caparena_items(600)
    path = tmp_path / "caparena_annots_eval.json"
    path.write_text(json.dumps(items))
    data = get_benchmark("caparena").with_protocol("msd-score").read(path)
    scores = write_scores(tmp_path / "s.jsonl", data)
    figures = {}
    for rounds in (1, 5):
        out = tmp_path / f"rounds{rounds}.json"
        capeval_here(CLI + ["caparena", "--data", str(path), "--scores", f"w={scores}", "--protocol", "msd-score",
                   "--shuffle-rounds", str(rounds), "--bootstrap", "0", "--json", str(out), "--quiet"])
        report = json.loads(out.read_text())
        assert report["protocol"]["shuffle_rounds"] == rounds
        system, expected = report["results"]["w"]["system"], msd_caparena_loop(items, rounds=rounds)
        assert system["spearman"] == pytest.approx(expected["spearman"], abs=1e-9)
        assert system["kendall_tau_b"] == pytest.approx(expected["kendall_tau_b"], abs=1e-9)
        figures[rounds] = (system["spearman"], system["kendall_tau_b"])
    assert figures[1] != figures[5]  # the rounds change the ranking on these battles
    default = run_benchmark("caparena", path, scores={"w": scores}, protocol="msd-score", bootstrap=0,
                            progress=False).to_dict()
    assert default["protocol"]["shuffle_rounds"] == 1
    assert default["results"]["w"]["system"]["spearman"] == pytest.approx(figures[1][0], abs=1e-9)
    bad = capeval_in_process(CLI + ["caparena", "--data", str(path), "--scores", f"w={scores}",
                                   "--shuffle-rounds", "5"])
    assert bad.returncode == 2 and "single-pass Elo" in bad.stderr


def test_caparena_official_protocol_stays_the_default(tmp_path):
    items = caparena_items()
    path = tmp_path / "caparena_annots_eval.json"
    path.write_text(json.dumps(items))
    data = load_benchmark("caparena", path)
    scores = write_scores(tmp_path / "s.jsonl", data)
    official = run_benchmark("caparena", path, scores={"w": scores}, bootstrap=0, progress=False).to_dict()
    assert official["protocol"]["variant"] == "official" and "tie_margin" not in official["protocol"]
    # ties included, human source left out, metric ties only at equal scores
    kept = [i for i in items if "human" not in (i["source1"], i["source2"])]
    agree = []
    for it in kept:
        d = score(it["caption1"]) - score(it["caption2"])
        metric = "tie" if d == 0 else "1" if d > 0 else "2"
        human = "1" if it["winner"] == it["source1"] else "2" if it["winner"] == it["source2"] else "tie"
        agree.append(metric == human)
    assert official["results"]["w"]["accuracy"] == pytest.approx(100 * np.mean(agree), abs=1e-9)
    bad = capeval_in_process(CLI + ["caparena", "--data", str(path), "--scores", f"w={scores}",
                                   "--protocol", "posh"])
    assert bad.returncode == 2 and "no protocol 'posh'" in bad.stderr and "msd-score" in bad.stderr


# -------------------------------------------------------------------------------------------------- DOCENT

def docent_rows(n: int = 80) -> list[dict]:
    rng = np.random.default_rng(17)
    return [{"uuid": f"nga-{k % 25}", "reference": "a painting", "model1": "A", "model2": "B",
             "model1_generation": "w " * int(rng.integers(1, 7)), "model2_generation": "v " * int(rng.integers(1, 7)),
             **{kind: LABELS[int(rng.integers(0, 5))] for kind in ("mistakes", "omissions", "overall_quality")}}
            for k in range(n)]


def msd_docent_loop(rows: list[dict], kind: str) -> dict[str, float]:
    """MSD-Score's docent.py, step by step (it reports ``overall_quality``; the same rule on the others)."""
    label_map = {"1_much_better": 2.0, "1_slightly_better": 1.0, "equal": 0.0, "2_slightly_better": -1.0,
                 "2_much_better": -2.0}
    h = np.array([label_map[r[kind]] for r in rows])
    p = np.array([score(r["model1_generation"]) - score(r["model2_generation"]) for r in rows])
    keep = h != 0
    return {f"accuracy:{kind}": 100 * np.mean((h[keep] > 0) == (p[keep] > 0)),
            f"kendall_tau_b:{kind}": 100 * kendalltau(h, p).statistic,
            f"spearman:{kind}": 100 * spearmanr(h, p).statistic,
            f"pearson:{kind}": 100 * pearsonr(h, p).statistic}


def test_docent_msd_protocol_equals_its_script_as_a_loop(tmp_path):
    rows = docent_rows()
    # a zero difference where humans preferred the first caption: the script counts it wrong
    rows[0].update(model1_generation="x x", model2_generation="v v", overall_quality="1_much_better")
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_benchmark("docent", path)
    scores = write_scores(tmp_path / "s.jsonl", data)
    out = tmp_path / "docent.json"
    stdout = capeval_here(CLI + ["docent", "--data", str(path), "--scores", f"w={scores}", "--protocol", "msd-score",
                        "--bootstrap", "10", "--json", str(out), "--quiet"]).stdout
    assert "Pearson (overall_quality)" in stdout
    result = json.loads(out.read_text())["results"]["w"]
    for kind in ("mistakes", "omissions", "overall_quality"):
        for key, value in msd_docent_loop(rows, kind).items():
            assert result[key] == pytest.approx(value, abs=1e-9), key
    official = run_benchmark("docent", path, scores={"w": scores}, bootstrap=0, progress=False).to_dict()["results"]["w"]
    assert "pearson:overall_quality" not in official  # PoSh's three-class protocol is the default
    assert official["accuracy:overall_quality"] != pytest.approx(result["accuracy:overall_quality"])


def test_long_caption_benchmarks_give_msd_the_scripts_mixture_sizes():
    from capeval_plugins import registry
    from capeval_plugins.metrics.msd import SETTINGS

    assert SETTINGS["long"] == (5, 3)
    for bench in ("caparena", "docent"):
        added = metric_options(bench, ["soft_msd", "msd_score"], [])
        assert added == ["soft_msd.setting=long", "msd_score.setting=long"]
        assert metric_options(bench, ["soft_msd"], ["soft_msd.k_image=7"])[0] == "soft_msd.setting=long"
        assert metric_options(bench, ["soft_msd"], ["setting=short"]) == ["setting=short"]
        assert get_benchmark(bench).with_protocol("msd-score").metric_defaults == get_benchmark(bench).metric_defaults
    assert registry.get("soft_msd").cls.Config(setting="long").setting == "long"


# --------------------------------------------------------------------------------------------------- COCO-CF

def test_coco_cf_reads_its_official_scripts_layout(tmp_path):
    """coco_eval_cf.py's --data_json: a list of {image_id, image_path, caption, negative_caption}, or a dict with a
    "data" list (its README: coco_cf_easy.json ...); one file per split, each a category; accuracy as its loop
    counts it (right when the faithful caption scores strictly higher)."""
    rng = np.random.default_rng(5)

    def items(n: int) -> list[dict]:
        return [{"image_id": k, "image_path": f"val2017/{k % 7:012d}.jpg",
                 "caption": "w " * int(rng.integers(1, 6)), "negative_caption": "v " * int(rng.integers(1, 6))}
                for k in range(n)]

    folder = tmp_path / "coco_cf"
    folder.mkdir()
    easy, hard = items(40), items(30)
    (folder / "coco_cf_easy.json").write_text(json.dumps(easy))
    (folder / "coco_cf_hard.json").write_text(json.dumps({"data": hard}))
    data = load_benchmark("coco-cf", folder)
    assert len(data) == 70 and data.categories == ["coco_cf_easy"] * 40 + ["coco_cf_hard"] * 30
    # one corpus per file, the pairs' groups their indices there (the script's i: MSD's COCO-CF starting draws)
    assert [len(rows) for rows in data.captions.corpora()] == [80, 60]
    assert data.captions.groups == [k for n in (40, 30) for k in range(n) for _ in range(2)]
    assert set(load_benchmark("coco-cf", folder / "coco_cf_hard.json").categories) == {"coco_cf_hard"}
    scores = write_scores(tmp_path / "s.jsonl", data)
    result = run_benchmark("coco-cf", folder, scores={"w": scores}, bootstrap=0, progress=False).to_dict()
    for name, split in (("coco_cf_easy", easy), ("coco_cf_hard", hard)):
        right = [score(i["caption"]) > score(i["negative_caption"]) for i in split]
        assert result["results"]["w"]["categories"][name]["accuracy"] == pytest.approx(100 * np.mean(right), abs=1e-9)
