"""The seeds' benchmarks through ``capeval bench`` with their official protocols (SugarCrepe, ActivityNet- /
YouCook2-Fact, VATEX-EVAL, CapArena), each checked against scipy or a plain loop over the raw file; score files
(``--scores`` / ``--save-scores``) round-trip; Spearman and system-level correlation; per-pair groups;
``--extras``; per-benchmark metric defaults and tie conventions."""
from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BENCHDATA as DEFAULT_BENCHDATA
from conftest import capeval_here, capeval_in_process, has_java
from scipy.stats import kendalltau, pearsonr, spearmanr

from capeval_plugins.bench import Captions, Ratings, load_benchmark, run_benchmark
from capeval_plugins.bench.protocols import RankPlan
from capeval_plugins.bench.ranking import bootstrap_elo
from capeval_plugins.contract import INDEX, Metric, MetricInfo, MetricResult, PointwiseMetric, StateSpec
from capeval_plugins.contract import decode_texts, encode_texts
from capeval_plugins.inputs import InputError

# CAPEVAL_BENCHDATA points a worktree that is not next to ../shared at the data
BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", DEFAULT_BENCHDATA))
real = pytest.mark.skipif(not BENCHDATA.is_dir(), reason="../shared/benchdata is not on this machine")
CLI = ["bench"]  # through capeval_here: cli.main in this process (no process boundary under test)


def info(name: str, references: str = "never", groups: bool = False) -> MetricInfo:
    return MetricInfo(name=name, display_name=name, description="", citation="", references=references,
                      images="never", groups=groups)


class Length(PointwiseMetric):
    """Words in the candidate, with an extra: its characters."""

    info = info("length")
    extra_names = ("chars",)

    def score(self, batch):
        return {"score": torch.tensor([float(len(c.split())) for c in batch.candidates], dtype=torch.float64),
                "chars": torch.tensor([float(len(c)) for c in batch.candidates], dtype=torch.float64)}


class GroupSpy(Metric):
    """A group metric: score = words / mean words of the caption's group; records every call's groups."""

    info = info("group_spy", groups=True)
    seen: list[list[int]] = []

    def states(self):
        return {"text": StateSpec("cat", torch.uint8, (-1,))}

    def map(self, batch):
        return {"text": encode_texts(batch.candidates)}

    def finalize(self, state):
        from capeval_plugins.contract import GROUP

        texts, groups = decode_texts(state["text"]), state[GROUP].tolist()
        type(self).seen.append(groups)
        words = torch.tensor([float(len(t.split())) for t in texts], dtype=torch.float64)
        mean = {g: float(np.mean([w for w, h in zip(words.tolist(), groups) if h == g])) for g in set(groups)}
        scores = words / torch.tensor([mean[g] for g in groups], dtype=torch.float64)
        return MetricResult("group_spy", float(scores.mean()), scores, state[INDEX])


def assert_same(a, b, where="") -> None:
    """Nested figures equal up to float rounding (the same computation on the same scores)."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{k}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-12, abs=1e-12, nan_ok=True), where
    else:
        assert a == b, where


# ------------------------------------------------------------------------------------------ statistics

@pytest.mark.parametrize("seed", range(6))
def test_weighted_spearman_equals_scipy_on_repeated_rows(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 300))
    x = rng.integers(0, 5, n).astype(float)
    y = np.round(x + rng.normal(0, 1.5, n), 1)
    w = rng.integers(0, 4, n)
    plan = RankPlan(x, y)
    assert plan.rho(w) == pytest.approx(spearmanr(np.repeat(x, w), np.repeat(y, w)).statistic, abs=1e-12)
    assert plan.rho() == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)


def test_spearman_and_system_level_correlation_equal_scipy():
    rng = np.random.default_rng(1)
    n = 90
    systems = [f"sys{i % 5}" for i in range(n)]
    cands = [" ".join(["w"] * int(k)) for k in rng.integers(1, 9, n)]
    human = np.array([len(c.split()) for c in cands]) + rng.normal(0, 2, n)
    data = Ratings(Captions([f"i{i // 5}" for i in range(n)], cands), human, systems=systems)
    result = run_benchmark("nebula", data, {"len": Length()}, cache=False, bootstrap=0, progress=False,
                           human_scale=(human.min(), human.max())).to_dict()["results"]["len"]
    words = np.array([len(c.split()) for c in cands], dtype=float)
    assert result["spearman"] == pytest.approx(100 * spearmanr(words, human).statistic, abs=1e-9)
    sys_x = [words[[s == k for s in systems]].mean() for k in sorted(set(systems))]
    sys_y = [human[[s == k for s in systems]].mean() for k in sorted(set(systems))]
    assert result["system"]["n"] == 5
    assert result["system"]["pearson"] == pytest.approx(100 * pearsonr(sys_x, sys_y).statistic, abs=1e-9)
    assert result["system"]["kendall_tau_b"] == pytest.approx(100 * kendalltau(sys_x, sys_y).statistic, abs=1e-9)
    assert result["system"]["spearman"] == pytest.approx(100 * spearmanr(sys_x, sys_y).statistic, abs=1e-9)


# ------------------------------------------------------------------------------------------ SugarCrepe

def sugarcrepe_folder(root: Path, pairs_per_subset: int = 6) -> Path:
    """Synthetic files in the official layout (one {idx: {filename, caption, negative_caption}} per subset)."""
    from capeval_plugins.bench.readers import SUGARCREPE_SUBSETS

    folder = root / "sugarcrepe"
    folder.mkdir()
    for s, subset in enumerate(SUGARCREPE_SUBSETS):
        items = {str(k): {"filename": f"{k:012d}.jpg", "caption": "a dog " + "x " * (k % 3),
                          "negative_caption": "a cat " + "y " * ((k + s) % 4)} for k in range(pairs_per_subset)}
        (folder / f"{subset}.json").write_text(json.dumps(items))
    return folder


def plain_sugarcrepe(folder: Path, score) -> dict[str, float]:
    out = {}
    for file in sorted(folder.glob("*.json")):
        items = json.loads(file.read_text()).values()
        out[file.stem] = 100 * np.mean([score(i["caption"]) > score(i["negative_caption"]) for i in items])
    return out


def write_length_scores(data, path: Path, fmt: str = "jsonl") -> None:
    rows = [{"image": img, "caption": c, "score": float(len(c.split()))}
            for img, c in zip(data.captions.images, data.captions.candidates)]
    if fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=["image", "caption", "score"])
            writer.writeheader()
            writer.writerows(rows)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def check_sugarcrepe(folder: Path, scores_file: Path, tmp_path: Path) -> dict:
    out = tmp_path / "sc.json"
    stdout = capeval_here(CLI + ["sugarcrepe", "--data", str(folder), "--scores", f"len={scores_file}",
                                 "--bootstrap", "50", "--json", str(out), "--quiet"]).stdout
    assert "| metric | n | replace_obj |" in stdout and "Replace" in stdout
    doc = json.loads(out.read_text())
    result = doc["results"]["len"]
    expected = plain_sugarcrepe(folder, lambda c: len(c.split()))
    for subset, accuracy in expected.items():
        assert result["categories"][subset]["accuracy"] == pytest.approx(accuracy, abs=1e-9)
    groups = {"Replace": ("replace_obj", "replace_att", "replace_rel"), "Swap": ("swap_obj", "swap_att"),
              "Add": ("add_obj", "add_att")}
    for group, members in groups.items():
        assert result["groups"][group]["accuracy"] == pytest.approx(np.mean([expected[m] for m in members]), abs=1e-9)
    assert doc["protocol"]["ties"] == "wrong" and result["scores_file"] == str(scores_file)
    return doc


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_sugarcrepe_official_layout_from_a_score_file(tmp_path, fmt):
    folder = sugarcrepe_folder(tmp_path)
    data = load_benchmark("sugarcrepe", folder)
    assert len(data) == 42 and (data.label == 0).all() and data.captions.references is None
    scores = tmp_path / f"scores.{fmt}"
    write_length_scores(data, scores, fmt)
    doc = check_sugarcrepe(folder, scores, tmp_path)
    assert doc["results"]["len"]["n_ties"] > 0  # ties exist and count as wrong


@real
def test_sugarcrepe_real_files_through_the_cli(tmp_path):
    folder = BENCHDATA / "sugarcrepe"
    data = load_benchmark("sugarcrepe", folder)
    assert len(data) == 7511
    sizes = {"add_att": 692, "add_obj": 2062, "replace_att": 788, "replace_obj": 1652, "replace_rel": 1406,
             "swap_att": 666, "swap_obj": 245}
    scores = tmp_path / "scores.jsonl"
    write_length_scores(data, scores)
    doc = check_sugarcrepe(folder, scores, tmp_path)
    assert {k: v["n"] for k, v in doc["results"]["len"]["categories"].items()} == sizes


def test_a_score_file_must_cover_every_row(tmp_path):
    folder = sugarcrepe_folder(tmp_path)
    data = load_benchmark("sugarcrepe", folder)
    scores = tmp_path / "scores.jsonl"
    write_length_scores(data, scores)
    lines = scores.read_text().splitlines()
    missing = json.loads(lines[3])
    key = lambda r: (r["image"], r["caption"])  # noqa: E731
    kept = [line for line in lines if key(json.loads(line)) != key(missing)]
    scores.write_text("\n".join(kept) + "\n")
    n_missing = len(lines) - len(kept)
    assert n_missing
    with pytest.raises(InputError, match=rf"{n_missing} of 84 benchmark rows have no score, e\.g\. row \d+: "):
        run_benchmark("sugarcrepe", folder, scores={"len": scores}, bootstrap=0, progress=False)
    proc = capeval_in_process(CLI + ["sugarcrepe", "--data", str(folder), "--scores", f"len={scores}", "--quiet"])
    assert proc.returncode == 2 and "have no score" in proc.stderr and "Traceback" not in proc.stderr
    # two different scores for one image and caption cannot be matched
    rows = [json.loads(line) for line in lines]
    rows.append({**rows[0], "score": rows[0]["score"] + 1})
    scores.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match="two different scores"):
        run_benchmark("sugarcrepe", folder, scores={"len": scores}, bootstrap=0, progress=False)
    rows[-1]["score"] = True
    scores.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match="is not a number"):
        run_benchmark("sugarcrepe", folder, scores={"len": scores}, bootstrap=0, progress=False)


# ----------------------------------------------------------------------------------- score round trip

def test_saved_scores_and_extras_round_trip(tmp_path):
    folder = sugarcrepe_folder(tmp_path)
    saved = tmp_path / "saved"
    first = run_benchmark("sugarcrepe", folder, {"len": Length()}, cache=False, bootstrap=200, progress=False,
                          extras=True, save_scores=saved).to_dict()
    assert set(first["results"]) == {"len", "len:chars"}
    assert [c["metrics"] for c in first["comparisons"]] == []  # extras are rows, not compared pairwise
    again = run_benchmark("sugarcrepe", folder, scores={"len": saved / "len.jsonl"}, bootstrap=200, progress=False,
                          extras=True).to_dict()
    for name in ("len", "len:chars"):
        for key in ("accuracy", "n", "n_ties", "ci95", "categories", "groups"):
            assert_same(again["results"][name][key], first["results"][name][key], f"{name}.{key}")
    # the extra evaluated as a metric of its own gives the same figures
    data = load_benchmark("sugarcrepe", folder)
    chars = np.array([float(len(c)) for c in data.captions.candidates])
    direct = run_benchmark("sugarcrepe", data, scores={"c": _write(tmp_path / "c.jsonl", data, chars)}, bootstrap=0,
                           progress=False).to_dict()
    assert direct["results"]["c"]["accuracy"] == pytest.approx(first["results"]["len:chars"]["accuracy"], abs=1e-9)


def _write(path: Path, data, values) -> Path:
    from capeval_plugins.bench.scorefiles import write_scores

    return write_scores(path, data, values)


@pytest.mark.skipif(not has_java(), reason="PTB tokenisation needs Java")
def test_cli_metric_json_equals_the_same_run_from_its_saved_scores(tmp_path):
    """``--metric cider --json`` and ``--scores cider=<its saved per-sample scores>`` give identical figures."""
    data_file = tmp_path / "pairs.json"
    rng = np.random.default_rng(0)
    words = "a dog cat man runs sits on grass red ball".split()
    pairs = [{"image": f"{k % 7}.jpg", "captions": [" ".join(rng.choice(words, 4)), " ".join(rng.choice(words, 5))],
              "label": int(k % 2), "references": [" ".join(rng.choice(words, 6)) for _ in range(3)],
              "category": "abc"[k % 3]} for k in range(40)]
    data_file.write_text(json.dumps(pairs))
    first, second, saved = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "saved"
    common = ["mceval", "--data", str(data_file), "--bootstrap", "100", "--quiet", "--no-cache"]
    capeval_here(CLI + common + ["--metric", "cider", "--metric", "bleu4", "--json", str(first),
                                 "--save-scores", str(saved)])
    capeval_here(CLI + common + ["--scores", f"cider={saved / 'cider.jsonl'}",
                                 "--scores", f"bleu4={saved / 'bleu4.jsonl'}", "--json", str(second)])
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    for name in ("cider", "bleu4"):
        for key in ("accuracy", "n", "n_ties", "ci95", "categories"):
            assert_same(b["results"][name][key], a["results"][name][key], f"{name}.{key}")
    assert_same(b["comparisons"], a["comparisons"])
    # mixing: a metric and a score file in one run are compared pairwise
    mixed = tmp_path / "m.json"
    capeval_here(CLI + common + ["--metric", "bleu4", "--scores", f"theirs={saved / 'cider.jsonl'}",
                                 "--json", str(mixed)])
    doc = json.loads(mixed.read_text())
    assert doc["comparisons"][0]["metrics"] == ["theirs", "bleu4"]
    assert doc["results"]["theirs"]["accuracy"] == pytest.approx(a["results"]["cider"]["accuracy"], rel=1e-12)


# ------------------------------------------------------------------------------------------ group metrics

def test_group_metrics_group_the_two_captions_of_each_pair(tmp_path):
    folder = sugarcrepe_folder(tmp_path)
    data = load_benchmark("sugarcrepe", folder)
    GroupSpy.seen = []
    report = run_benchmark("sugarcrepe", data, {"g": GroupSpy()}, cache=False, bootstrap=0, progress=False)
    (groups,) = GroupSpy.seen
    pair_of_row = {}
    for k, (a, b) in enumerate(zip(data.first.tolist(), data.second.tolist())):
        pair_of_row[a] = pair_of_row[b] = k
    assert len(set(groups)) == len(data)  # one group per pair, not per image
    by_group = {}
    for row, g in enumerate(groups):
        by_group.setdefault(g, set()).add(pair_of_row[row])
    assert all(len(v) == 1 for v in by_group.values())
    # score = words / mean words of the pair: the pair's two scores average to 1
    s = report.runs["g"].scores
    np.testing.assert_allclose((s[data.first] + s[data.second]) / 2, 1.0, atol=1e-12)


# ----------------------------------------------------------------------------------------------- FactVC

def factvc_plain(folder: Path, models: list[str], files: dict[str, str]):
    """The official script's rows, written independently: model-major over vids.txt."""
    vids = [v.strip() for v in (folder / "vids.txt").read_text().splitlines() if v.strip()]
    anno = json.loads((folder / "factuality_annotation.json").read_text())
    norm = lambda t: " ".join(re.sub("[^a-zA-Z]", " ", t).strip().lower().split())  # noqa: E731
    cands, para, sent, word, systems = [], [], [], [], []
    for model in models:
        path = folder / files[model]
        results = json.loads(path.read_text())["results"] if path.is_file() else None
        for vid in vids:
            entry = anno[vid][model]
            flagged, spans, total = 0, 0, 0
            for s in entry["sentences"]:
                s = s.replace(".", "").strip()
                opens = [i for i, c in enumerate(s) if c == "["]
                closes = [i for i, c in enumerate(s) if c == "]"]
                flagged += bool(opens)
                total += len(s.split())
                spans += sum(len(s[a:b].split()) for a, b in zip(opens, closes))
            text = (" ".join(x["sentence"].strip() for x in results[vid]) if results is not None
                    else " ".join(entry["sentences"]).replace("[", "").replace("]", ""))
            cands.append(norm(text))
            para.append(entry["paragraph_score"])
            sent.append(-flagged / len(entry["sentences"]))
            word.append(-spans / total)
            systems.append(model)
    return cands, np.array(para, float), np.array(sent), np.array(word), systems


def check_factvc(name: str, folder: Path, tmp_path: Path) -> dict:
    from capeval_plugins.bench.readers import FACTVC

    dataset = "activitynet" if name.startswith("activitynet") else "youcook2"
    cands, para, sent, word, systems = factvc_plain(folder, list(FACTVC[dataset]), FACTVC[dataset])
    data = load_benchmark(name, folder)
    assert data.captions.candidates == cands and data.systems == systems
    out = tmp_path / f"{name}.json"
    scores = tmp_path / "len.jsonl"
    write_length_scores(data, scores)
    stdout = capeval_here(CLI + [name, "--data", str(folder), "--scores", f"len={scores}", "--bootstrap", "20",
                        "--json", str(out), "--quiet"]).stdout
    assert "Pearson (paragraph)" in stdout and "System level (6 systems" in stdout
    result = json.loads(out.read_text())["results"]["len"]
    x = np.array([len(c.split()) for c in cands], float)
    for column, y in (("paragraph", para), ("sentence", sent), ("word", word)):
        assert result[f"pearson:{column}"] == pytest.approx(100 * pearsonr(x, y).statistic, abs=1e-9)
        assert result[f"spearman:{column}"] == pytest.approx(100 * spearmanr(x, y).statistic, abs=1e-9)
        means = lambda v: [v[[s == m for s in systems]].mean() for m in sorted(set(systems))]  # noqa: E731
        assert result["system"][f"pearson:{column}"] == pytest.approx(
            100 * pearsonr(means(x), means(y)).statistic, abs=1e-9)
    return result


def factvc_folder(root: Path) -> Path:
    """ActivityNet-Fact in the official layout, 3 videos; the PDVC caption files absent as in the public repo."""
    from capeval_plugins.bench.readers import FACTVC

    folder = root / "activitynet"
    (folder / "captions").mkdir(parents=True)
    vids = ["v_a", "v_b", "v_c"]
    (folder / "vids.txt").write_text("\n".join(vids) + "\n")
    anno, rng = {}, np.random.default_rng(0)
    for k, vid in enumerate(vids):
        anno[vid] = {}
        for m, model in enumerate(FACTVC["activitynet"]):
            sentences = ["a man [walks a dog] in the park .", "he throws a ball ."][: 1 + (k + m) % 2]
            if (k + m) % 3 == 0:
                sentences = ["two people, talking 2 [loudly] .", "the [red car] stops [here] ."]
            anno[vid][model] = {"paragraph_score": int(rng.integers(1, 6)), "sentences": sentences}
            if not model.startswith("PDVC"):
                file = folder / "captions" / FACTVC["activitynet"][model]
                results = json.loads(file.read_text())["results"] if file.exists() else {}
                results[vid] = [{"sentence": s.replace("[", "").replace("]", "") + f" M{m}", "timestamp": [0, 1]}
                                for s in sentences]
                file.write_text(json.dumps({"version": "1", "results": results}))
    (folder / "factuality_annotation.json").write_text(json.dumps(anno))
    (folder / "captions" / "gt_ae_test_1_para.json").write_text(json.dumps({v: f"A ref, for {v}!" for v in vids}))
    (folder / "captions" / "gt_ae_test_2_para.json").write_text(json.dumps({"v_a": "Second ref."}))
    return folder


def test_activitynet_fact_official_layout(tmp_path):
    folder = factvc_folder(tmp_path)
    from capeval_plugins.bench.readers import FACTVC

    files = {m: f"captions/{f}" for m, f in FACTVC["activitynet"].items()}
    cands, *_ = factvc_plain(folder, list(FACTVC["activitynet"]), files)
    data = load_benchmark("activitynet-fact", folder)
    assert data.captions.candidates == cands and len(cands) == 18
    assert data.captions.references[0] == ["a ref for v a", "second ref"]   # two references, normalised
    assert data.captions.references[1] == ["a ref for v b", "a ref for v b"]  # the first again
    assert data.notes["captions_from_annotation"] == ["PDVC_gt", "PDVC_pred"]


@real
@pytest.mark.parametrize("name, sub, rows", [("youcook2-fact", "youcook2", 600),
                                             ("activitynet-fact", "activitynet", 1200)])
def test_factvc_real_files_through_the_cli(tmp_path, name, sub, rows):
    result = check_factvc(name, BENCHDATA / "factvc" / sub, tmp_path)
    assert result["n"] == rows


# ------------------------------------------------------------------------------------------- VATEX-EVAL

def vatex_file(root: Path, videos: int = 12) -> Path:
    rng = np.random.default_rng(3)
    data = {}
    for v in range(videos):
        vid = f"vid{v}_000001_000011"
        scores = [[float(s) for s in rng.integers(1, 6, 3)] for _ in range(6)]
        data[vid] = {"vid": vid, "cands": [" ".join(["w"] * int(rng.integers(1, 12))) for _ in range(6)],
                     "scores": json.dumps(scores), "refs": [[f"ref {v} {k}" for k in range(9)]]}
    path = root / "vid_cans_score_dict.json"
    path.write_text(json.dumps(data))
    return path


def check_vatex(path: Path, tmp_path: Path) -> dict:
    raw = json.loads(path.read_text())
    human = np.array([row for v in raw.values() for row in json.loads(v["scores"])])
    cands = [c for v in raw.values() for c in v["cands"]]
    data = load_benchmark("vatex-eval", path)
    scores = np.array([len(c.split()) + 1e-5 * (k % 7) for k, c in enumerate(cands)])  # rounding matters
    out = tmp_path / "vatex.json"
    file = _write(tmp_path / "v.jsonl", data, scores)
    stdout = capeval_here(CLI + ["vatex-eval", "--data", str(path), "--scores", f"m={file}", "--bootstrap", "10",
                        "--json", str(out), "--quiet"]).stdout
    assert "Kendall τb (annotator1)" in stdout
    result = json.loads(out.read_text())["results"]["m"]
    rounded = np.round(scores, 4)
    taus = [kendalltau(rounded, human[:, a]).statistic for a in range(3)]
    rhos = [spearmanr(rounded, human[:, a]).statistic for a in range(3)]
    assert result["kendall_tau_b"] == pytest.approx(100 * np.mean(taus), abs=1e-9)
    assert result["spearman"] == pytest.approx(100 * np.mean(rhos), abs=1e-9)
    assert result["kendall_tau_b:annotator2"] == pytest.approx(100 * taus[1], abs=1e-9)
    return result


def test_vatex_eval_layout_and_references(tmp_path):
    path = vatex_file(tmp_path)
    check_vatex(path, tmp_path)
    from capeval_plugins.bench.runner import keep_references

    data = load_benchmark("vatex-eval", path)
    assert len(data.captions) == 72 and all(len(r) == 9 for r in data.captions.references)
    assert [r[:1] for r in data.captions.references[:6]] == [["ref 0 0"]] * 6
    assert keep_references(data, 1).captions.references[0] == ["ref 0 0"]
    assert keep_references(data, 0).captions.references is None
    with pytest.raises(InputError, match="fewer references"):
        keep_references(data, 10)


@real
def test_vatex_eval_real_file(tmp_path):
    result = check_vatex(BENCHDATA / "vatex_eval" / "vid_cans_score_dict.json", tmp_path)
    assert result["n"] == 18000


# --------------------------------------------------------------------------------------------- CapArena

MODELS = ["GPT-4o-0806", "Gemini-2.0-flash-exp", "InternVL2-26B", "Gemini-1.5-pro-002", "LLaVA-1.5-7B",
          "Qwen2-VL-2B-Instruct"]


def caparena_file(root: Path, n: int = 240) -> Path:
    rng = np.random.default_rng(5)
    items = []
    for k in range(n):
        a, b = rng.choice(MODELS + ["human"], 2, replace=False).tolist()
        winner = [a, b, "tie", "tie (bothbad)"][int(rng.integers(0, 4))]
        items.append({"img": f"docci_{k % 40}.jpg", "source1": a, "source2": b,
                      "caption1": "w " * int(rng.integers(1, 6)), "caption2": "v " * int(rng.integers(1, 6)),
                      "ref": "a reference", "winner": winner, "cluster": f"level {k % 4 + 1}", "in-400": True})
    path = root / "caparena_annots_eval.json"
    path.write_text(json.dumps(items))
    return path


def plain_agreement(items, score, margin=0.0) -> tuple[float, dict]:
    """The official caption-level agreement with ties included, written as a loop."""
    agree = {"overall": [], **{f"level {i}": [] for i in range(1, 5)}}
    for it in items:
        if "human" in (it["source1"], it["source2"]):
            continue
        d = score(it["caption1"]) - score(it["caption2"])
        metric = "tie" if abs(d) <= margin else ("1" if d > 0 else "2")
        human = "1" if it["winner"] == it["source1"] else "2" if it["winner"] == it["source2"] else "tie"
        agree["overall"].append(metric == human)
        agree[it["cluster"]].append(metric == human)
    return 100 * np.mean(agree["overall"]), {k: 100 * np.mean(v) for k, v in agree.items() if k != "overall"}


def test_caparena_agreement_and_tie_conventions(tmp_path):
    path = caparena_file(tmp_path)
    items = json.loads(path.read_text())
    data = load_benchmark("caparena", path)
    assert data.excluded == sum("human" in (i["source1"], i["source2"]) for i in items)
    words = lambda c: len(c.split())  # noqa: E731
    for margin in (0.0, 1.0):
        out = tmp_path / f"c{margin}.json"
        scores = _write(tmp_path / "s.jsonl", data, np.array([float(words(c)) for c in data.captions.candidates]))
        capeval_here(CLI + ["caparena", "--data", str(path), "--scores", f"w={scores}", "--tie-margin", str(margin),
                   "--bootstrap", "20", "--json", str(out), "--quiet"])
        result = json.loads(out.read_text())["results"]["w"]
        overall, levels = plain_agreement(items, words, margin)
        assert result["accuracy"] == pytest.approx(overall, abs=1e-9)
        for level, value in levels.items():
            assert result["categories"][level]["accuracy"] == pytest.approx(value, abs=1e-9)
        assert result["system"]["n"] == len(MODELS)
    # --ties wrong: a metric tie is never right, even against a human tie
    wrong = run_benchmark("caparena", data, scores={"w": scores}, bootstrap=0, progress=False, ties="wrong",
                          tie_margin=1.0).to_dict()["results"]["w"]
    assert wrong["accuracy"] < result["accuracy"]


def test_bootstrap_elo_equals_the_pandas_procedure_of_the_official_code():
    """Elo rounds updated together equal one sequential loop per round over pandas' resampled battles."""
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(2)
    n, models = 60, 5
    first = rng.integers(0, models, n)
    second = (first + rng.integers(1, models, n)) % models
    outcome = rng.choice([0.0, 0.5, 1.0], n)
    got = bootstrap_elo(first, second, outcome, models, rounds=30)
    battles = pd.DataFrame({"a": first, "b": second, "s": outcome})
    np.random.seed(42)
    rounds = []
    for _ in range(30):
        rating = {}
        for a, b, s in battles.sample(frac=1.0, replace=True)[["a", "b", "s"]].itertuples(index=False):
            ra, rb = rating.get(a, 1000.0), rating.get(b, 1000.0)
            rating[a] = ra + 4 * (s - 1 / (1 + 10 ** ((rb - ra) / 400)))
            rating[b] = rb + 4 * (1 - s - 1 / (1 + 10 ** ((ra - rb) / 400)))
        rounds.append(rating)
    expected = pd.DataFrame(rounds).median()
    np.testing.assert_allclose([expected[m] for m in range(models)], got, rtol=0, atol=1e-9)


# ------------------------------------------------------------------------------ options and conventions

def test_benchmark_metric_defaults_apply_unless_the_user_sets_the_option(monkeypatch):
    import dataclasses

    from capeval_plugins.bench import benchmarks

    bench = dataclasses.replace(benchmarks.BENCHMARKS["sugarcrepe"], metric_defaults={"cider": {"sigma": 5.0}})
    monkeypatch.setitem(benchmarks.BENCHMARKS, "sugarcrepe", bench)
    assert benchmarks.metric_options("sugarcrepe", ["cider", "bleu4"], []) == ["cider.sigma=5.0"]
    assert benchmarks.metric_options("sugarcrepe", ["cider"], ["cider.sigma=6"]) == ["cider.sigma=6"]
    assert benchmarks.metric_options("sugarcrepe", ["cider"], ["sigma=6"]) == ["sigma=6"]
    assert benchmarks.metric_options("sugarcrepe", ["bleu4"], []) == []
    bench = dataclasses.replace(bench, metric_defaults={"cider": {"no_such_option": 1}})
    monkeypatch.setitem(benchmarks.BENCHMARKS, "sugarcrepe", bench)
    assert benchmarks.metric_options("sugarcrepe", ["cider"], []) == []  # a metric without the key is left as is
    from capeval_plugins.commands.bench import build_metrics

    monkeypatch.setitem(benchmarks.BENCHMARKS, "sugarcrepe",
                        dataclasses.replace(bench, metric_defaults={"cider": {"sigma": 5.0}}))
    assert build_metrics(["cider"], [], "sugarcrepe")["cider"].config.sigma == 5.0
    assert build_metrics(["cider"], ["cider.sigma=7"], "sugarcrepe")["cider"].config.sigma == 7.0


def test_each_benchmark_carries_its_official_tie_convention(tmp_path):
    from capeval_plugins.bench import get_benchmark

    assert get_benchmark("sugarcrepe").protocol.ties == "wrong"
    assert get_benchmark("pascal50s").protocol.ties == "wrong"
    assert get_benchmark("caparena").protocol.ties == "tie"
    folder = sugarcrepe_folder(tmp_path)
    default = run_benchmark("sugarcrepe", folder, {"len": Length()}, cache=False, bootstrap=0, progress=False)
    half = run_benchmark("sugarcrepe", folder, {"len": Length()}, cache=False, bootstrap=0, progress=False,
                         ties="half")
    ties = default.to_dict()["results"]["len"]["n_ties"]
    assert default.settings["ties"] == "wrong" and ties > 0
    gained = half.to_dict()["results"]["len"]["accuracy"] - default.to_dict()["results"]["len"]["accuracy"]
    per_subset = [c["n"] for c in default.to_dict()["results"]["len"]["categories"].values()]
    assert gained > 0 and len(set(per_subset)) == 1
    assert gained == pytest.approx(100 * 0.5 * ties / sum(per_subset), abs=1e-9)  # equal subsets: pooled = mean


def test_ties_b_is_polos_pascal50s_loop(tmp_path):
    """``--ties b``: Polos's compute_pascal50s.py decides ``0 if a > b else 1`` per pair, so a tie votes for B."""
    rng = np.random.default_rng(5)
    data = {cat: [{"image": f"{cat}{k}.jpg", "captions": ["w " * int(rng.integers(1, 4)), "v " * int(rng.integers(1, 4))],
                   "label": int(rng.integers(0, 2)), "references": ["a ref"]} for k in range(40)]
            for cat in ("HC", "HI", "HM", "MM")}
    path = tmp_path / "pascal_50s.json"
    path.write_text(json.dumps(data))
    scores, out = tmp_path / "w.jsonl", tmp_path / "r.json"
    scores.write_text("".join(json.dumps({"image": p["image"], "caption": " ".join(c.split()),
                                          "score": float(len(c.split()))}) + "\n"
                              for pairs in data.values() for p in pairs for c in p["captions"]))
    capeval_here(CLI + ["pascal50s", "--data", str(path), "--scores", f"w={scores}", "--ties", "b", "--bootstrap", "0",
               "--json", str(out), "--quiet"])
    result = json.loads(out.read_text())["results"]["w"]
    for cat, pairs in data.items():
        a, b = ([float(len(p["captions"][i].split())) for p in pairs] for i in (0, 1))
        polos = [(0 if x > y else 1) == p["label"] for x, y, p in zip(a, b, pairs)]
        assert result["categories"][cat]["accuracy"] == pytest.approx(100 * np.mean(polos), abs=1e-9)
    assert result["n_ties"] > 0 and json.loads(out.read_text())["protocol"]["ties"] == "b"


# ------------------------------------------------------------------------------------- ActivityNet-FOIL

def anet_foil_folder(root: Path) -> Path:
    """EMScore's storage layout: right / foiled paragraphs, candidate segments (test 1), references (test 2)."""
    folder = root / "anet"
    folder.mkdir()
    rng = np.random.default_rng(7)
    right, foil, test1, test2 = {}, {}, {}, {}
    for v in range(9):
        vid = f"v_{v}"
        n = int(rng.integers(1, 4))
        right[vid] = [{"sentence": "a man " + "w " * int(rng.integers(0, 5))} for _ in range(n)]
        foil[vid] = [{"sentence": "a dog " + "v " * int(rng.integers(0, 5))} for _ in range(n)]
        test1[vid] = {"duration": 30.0, "timestamps": [[10 * i, 10 * i + 9.5] for i in range(n)], "sentences": []}
        test2[vid] = {"duration": 30.0, "timestamps": [[0, 12], [12.5, 30]],
                      "sentences": [f"ref one {v}", f"ref two {v}"]}
    right["v_extra"] = [{"sentence": "only right"}]  # no foil: not a pair
    for name, data in (("final_right_video_sentences.json", {"results": right}),
                       ("final_foil_video_sentences.json", {"results": foil}),
                       ("anet_entities_test_1.json", test1), ("anet_entities_test_2.json", test2)):
        (folder / name).write_text(json.dumps(data))
    return folder


def test_activitynet_foil_scores_videos_by_their_mean_sentence(tmp_path):
    folder = anet_foil_folder(tmp_path)
    data = load_benchmark("activitynet-foil", folder)
    assert len(data) == 9 and data.notes["videos_skipped"] == 1
    right = json.loads((folder / "final_right_video_sentences.json").read_text())["results"]
    foil = json.loads((folder / "final_foil_video_sentences.json").read_text())["results"]
    words = lambda s: len(s.split())  # noqa: E731
    expected = 100 * np.mean([np.mean([words(x["sentence"]) for x in right[v]]) >
                              np.mean([words(x["sentence"]) for x in foil[v]]) for v in foil])
    result = run_benchmark("activitynet-foil", folder, {"len": Length()}, cache=False, bootstrap=0, progress=False
                           ).to_dict()["results"]["len"]
    assert result["accuracy"] == pytest.approx(expected, abs=1e-9) and result["n"] == 9
    # references: the test-2 sentences the segment overlaps by more than 40 %
    first = data.captions.candidates.index(right["v_0"][0]["sentence"].strip())
    assert data.captions.references[first] == ["ref one 0"]           # [0, 9.5] covers 10 of [0, 12]'s 13 s
    assert data.captions.segments[first] == (0.0, 9.5, 30.0)


def test_video_folders_resolve_to_frames_cut_and_sampled(tmp_path):
    from capeval_plugins.bench.data import resolve_images

    video = tmp_path / "frames" / "v_0"
    video.mkdir(parents=True)
    for i in range(30):
        (video / f"{i}.jpg").write_bytes(b"")
    names = [str(video / f"{i}.jpg") for i in range(30)]
    assert resolve_images(["v_0"], tmp_path / "frames", "b") == [names]              # numeric order, not 0, 1, 10
    assert resolve_images(["v_0"], tmp_path / "frames", "b", [(10.0, 20.0, 30.0)]) == [names[10:20]]
    sampled = resolve_images(["v_0"], tmp_path / "frames", "b", frames=10)[0]
    assert sampled == [names[int(i)] for i in np.linspace(0, 29, 10)]


def test_coco_cf_reads_the_sugarcrepe_layout_and_the_generic_pairwise_format(tmp_path):
    folder = sugarcrepe_folder(tmp_path)
    (folder / "replace_att.json").rename(folder / "Replace-Att.json")
    data = load_benchmark("coco-cf", folder)
    assert len(data) == 42 and "Replace-Att" in data.categories
    expected = plain_sugarcrepe(folder, lambda c: len(c.split()))
    result = run_benchmark("coco-cf", data, {"len": Length()}, cache=False, bootstrap=0, progress=False
                           ).to_dict()["results"]["len"]
    assert result["accuracy"] == pytest.approx(np.mean(list(expected.values())), abs=1e-9)
    flat = tmp_path / "pairs.jsonl"
    flat.write_text(json.dumps({"image": "a.jpg", "captions": ["a b", "c"], "label": 0, "category": "Swap-Obj"}) + "\n")
    assert load_benchmark("coco-cf", flat).categories == ["Swap-Obj"]


class FrameCount(PointwiseMetric):
    """A video metric whose score is the number of frames it was given."""

    info = MetricInfo(name="frame_count", display_name="frame_count", description="", citation="",
                      references="never", images="always", video=True)

    def score(self, batch):
        counts = [float(len(batch.images[i])) for i in batch.image_index.tolist()]
        return {"score": torch.tensor(counts, dtype=torch.float64)}


def test_video_metrics_get_their_own_frame_count_through_the_cli(tmp_path):
    from PIL import Image

    frames = tmp_path / "frames"
    path = vatex_file(tmp_path, videos=2)
    for vid in json.loads(path.read_text()):
        (frames / vid).mkdir(parents=True)
        for i in range(12):
            Image.new("RGB", (8, 8), (i, 0, 0)).save(frames / vid / f"{i}.jpg")
    metrics = {"a": FrameCount(), "b": FrameCount(), "c": FrameCount()}
    report = run_benchmark("vatex-eval", path, metrics, images=frames, cache=False, bootstrap=0, progress=False,
                           frames={"a": 10, "*": 4})
    assert set(report.runs["a"].scores.tolist()) == {10.0}   # EMScore's 10 uniform frames
    assert set(report.runs["b"].scores.tolist()) == {4.0}
    from capeval_plugins.commands.bench import parse_frames

    assert parse_frames(["10"]) == 10 and parse_frames(["4", "a=10"]) == {"*": 4, "a": 10}
    with pytest.raises(InputError, match="--frames expects"):
        parse_frames(["a=0"])


def test_caparena_model_level_equals_scipy_on_the_elo_ranking(tmp_path):
    from scipy.stats import kendalltau as kt

    from capeval_plugins.bench.benchmarks import CAPARENA_HUMAN_RANKING
    from capeval_plugins.bench.ranking import rank_by

    path = caparena_file(tmp_path)
    data = load_benchmark("caparena", path)
    scores = np.array([float(len(c.split())) for c in data.captions.candidates])
    result = run_benchmark("caparena", data, scores={"w": _write(tmp_path / "w.jsonl", data, scores)}, bootstrap=0,
                           progress=False).to_dict()["results"]["w"]["system"]
    names = sorted({m for pair in data.pair_systems for m in pair})
    index = {m: i for i, m in enumerate(names)}
    a, b = scores[data.first], scores[data.second]
    outcome = np.where(a == b, 0.5, (a > b).astype(float))
    order = rank_by(bootstrap_elo(np.array([index[x] for x, _ in data.pair_systems]),
                                  np.array([index[y] for _, y in data.pair_systems]), outcome, len(names)), names)
    human = [CAPARENA_HUMAN_RANKING.index(m) + 1 for m in order]
    assert result["n"] == len(names) == len(order)
    assert result["spearman"] == pytest.approx(100 * spearmanr(human, range(len(order))).statistic, abs=1e-9)
    assert result["kendall_tau_b"] == pytest.approx(100 * kt(human, range(len(order))).statistic, abs=1e-9)


# ----------------------------------------------------------------------------------------------- DOCENT

LABELS = ["1_much_better", "1_slightly_better", "equal", "2_slightly_better", "2_much_better"]


def docent_rows(n: int = 60) -> list[dict]:
    rng = np.random.default_rng(11)
    rows = []
    for k in range(n):
        rows.append({"uuid": f"nga-{k % 20}", "reference": "a painting of a knight and two women",
                     "model1": "A", "model2": "B", "model1_generation": "w " * int(rng.integers(1, 9)),
                     "model2_generation": "v " * int(rng.integers(1, 9)),
                     **{kind: LABELS[int(rng.integers(0, 5))] for kind in ("mistakes", "omissions", "overall_quality")}})
    return rows


def plain_docent(rows, score) -> dict[str, float]:
    """PoSh's coarse protocol written as a loop."""
    out = {}
    for kind in ("mistakes", "omissions", "overall_quality"):
        diffs = [score(r["model1_generation"]) - score(r["model2_generation"]) for r in rows]
        labels = [LABELS.index(r[kind]) for r in rows]
        threshold = sorted(abs(d) for d in diffs)[sum(lab == 2 for lab in labels)]
        right = 0
        for d, lab in zip(diffs, labels):
            predicted = 0 if d >= threshold else 2 if -d >= threshold else 1
            right += predicted == {0: 0, 1: 0, 2: 1, 3: 2, 4: 2}[lab]
        human = [{0: 2, 1: 1, 2: 0, 3: -1, 4: -2}[lab] for lab in labels]
        out[f"accuracy:{kind}"] = 100 * right / len(rows)
        out[f"spearman:{kind}"] = 100 * spearmanr(human, diffs).statistic
        out[f"kendall_tau_b:{kind}"] = 100 * kendalltau(human, diffs).statistic
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_docent_coarse_protocol_equals_posh_script_as_a_loop(tmp_path, fmt):
    rows = docent_rows()
    path = tmp_path / f"test.{fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "docent.json"
    stdout = capeval_here(CLI + ["docent", "--data", str(path), "--scores", f"len={_len_scores(tmp_path, path)}",
                        "--bootstrap", "30", "--json", str(out), "--quiet", "--plot", str(tmp_path)]).stdout
    assert "accuracy (overall_quality)" in stdout
    result = json.loads(out.read_text())["results"]["len"]
    for key, value in plain_docent(rows, lambda c: len(c.split())).items():
        assert result[key] == pytest.approx(value, abs=1e-9), key
    bad = [dict(rows[0], omissions="better")]
    path.with_suffix(".bad.jsonl").write_text(json.dumps(bad[0]) + "\n")
    with pytest.raises(InputError, match="omissions must be one of"):
        load_benchmark("docent", path.with_suffix(".bad.jsonl"))


def _len_scores(tmp_path: Path, path: Path) -> Path:
    data = load_benchmark("docent", path)
    return _write(tmp_path / "len.jsonl", data, np.array([float(len(c.split())) for c in data.captions.candidates]))


def test_caparena_calibrated_tie_margin_predicts_at_most_the_human_ties(tmp_path):
    path = caparena_file(tmp_path)
    items = [i for i in json.loads(path.read_text()) if "human" not in (i["source1"], i["source2"])]
    data = load_benchmark("caparena", path)
    scores = np.array([float(len(c.split())) for c in data.captions.candidates])
    file = _write(tmp_path / "w.jsonl", data, scores)
    out = tmp_path / "cal.json"
    capeval_here(CLI + ["caparena", "--data", str(path), "--scores", f"w={file}", "--tie-margin", "calibrated",
               "--bootstrap", "0", "--json", str(out), "--quiet"])
    result = json.loads(out.read_text())["results"]["w"]
    words = lambda c: len(c.split())  # noqa: E731
    diffs = [words(i["caption1"]) - words(i["caption2"]) for i in items]
    human = ["1" if i["winner"] == i["source1"] else "2" if i["winner"] == i["source2"] else "tie" for i in items]
    threshold = sorted(abs(d) for d in diffs)[human.count("tie")]
    metric = ["1" if d >= threshold else "2" if -d >= threshold else "tie" for d in diffs]  # PoSh's loop
    assert result["accuracy"] == pytest.approx(100 * np.mean([m == h for m, h in zip(metric, human)]), abs=1e-9)
    assert result["n_ties"] == metric.count("tie") <= human.count("tie")
    proc = capeval_in_process(CLI + ["caparena", "--data", str(path), "--scores", f"w={file}", "--tie-margin", "-1"])
    assert proc.returncode == 2 and "calibrated" in proc.stderr
