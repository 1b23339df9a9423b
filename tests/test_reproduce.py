"""`capeval reproduce`: the shipped table of published figures, the plan of what each pair needs, the judging
within a paper's rounding, and the text-only rows on the real benchmark data in ../shared/benchdata."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import kendalltau

from capeval_plugins import registry
from capeval_plugins.bench import reproduce as rp
from capeval_plugins.bench.benchmarks import BENCHMARKS
from capeval_plugins.bench.data import Captions, Pairs, Ratings
from capeval_plugins.cli import main
from conftest import BENCHDATA, has_java

STANDARD = ["bleu4", "rouge_l", "meteor", "cider", "spice", "bertscore", "clipscore", "refclipscore", "pacscore",
            "refpacscore", "polos", "fleur", "reffleur"]


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def test_the_table_names_what_capeval_knows():
    """Every column is a benchmark, protocol and statistic capeval reports; every entry a registered metric (or
    one being added); the field's standard rows are there for the standard benchmarks."""
    values = rp.load_published()
    names = set(registry.metrics())
    for v in values:
        assert v.setting.benchmark in BENCHMARKS
        assert v.setting.protocol is None or v.setting.protocol in BENCHMARKS[v.setting.benchmark].protocols()
        assert v.entry.metric in names or v.entry.external, v.entry
        assert 0 <= v.value <= 100 and v.decimals in (1, 2)
    have = {(v.entry.id, v.setting.benchmark) for v in values}
    for entry in STANDARD:
        for bench in ("flickr8k-expert", "flickr8k-cf", "composite"):
            assert (entry, bench) in have, (entry, bench)
    for entry in ("bleu4", "rouge_l", "meteor", "cider", "spice"):
        assert {(entry, b) for b in ("nebula", "pascal50s", "foil", "polaris")} <= have
    assert {v.entry.id for v in values} >= {"discode_lv", "rigel", "soft_msd", "vilbertscore", "redemption_score"}
    sources = rp.sources()
    assert all(v.source in sources for v in values)


def test_the_docs_count_of_published_values_is_the_files():
    """docs/bench.md states how many values ``published.json`` holds and in how many tables: counted here from the
    raw file (every non-null number of every row), independently of :func:`rp.load_published`, which must agree."""
    import re

    doc = json.loads(rp.PUBLISHED.read_text(encoding="utf-8"))
    count = sum(v is not None for table in doc["tables"] for row in table["rows"] for v in row[1])
    assert count == len(rp.load_published())
    text = (Path(__file__).parents[1] / "docs" / "bench.md").read_text(encoding="utf-8")
    stated = re.search(r"published\.json`: ([\d,]+) values\s+in (\d+) tables", text)
    assert stated, "docs/bench.md no longer states the count"
    assert (int(stated.group(1).replace(",", "")), int(stated.group(2))) == (count, len(doc["tables"]))


def test_the_meteor_flickr8k_cf_source_difference_is_noted():
    """The papers print METEOR's Flickr8k-CF tau-b as 22.2, CaptionEvalKit 22.3 (the PAC-S README's 22.269): the
    table keeps the papers' figure and the benchmark's notes say so, as for BLEU-4's 16.4 / 16.9."""
    meteor = {v.value for v in rp.load_published()
              if v.entry.id == "meteor" and v.setting.benchmark == "flickr8k-cf" and v.statistic == "kendall_tau_b"}
    assert meteor == {22.2}
    note = rp.benchmark_notes()["flickr8k-cf"]
    assert all(s in note for s in ("METEOR", "22.2", "22.3", "22.269", "16.4", "16.9"))


def test_every_entrys_options_build_its_metric_without_loading_weights(offline_cache):
    """Each entry's ``options`` pass its metric's configuration checks and reach its config, typed (``load``) and
    as the strings ``capeval reproduce`` passes with each benchmark's defaults (``build``), so a renamed or
    retyped option fails here, not in a user's run. Nothing loads (no weights exist here: the default PAC-S and
    Polos folders are absent). A blocked entry needs a user's option first (Rigel's checkpoint): its own options
    still pass ``build_config``."""
    import capeval_plugins
    from capeval_plugins.contract import build_config

    values = rp.load_published()
    benchmarks: dict[rp.Entry, set[str]] = {}
    for v in values:
        benchmarks.setdefault(v.entry, set()).add(v.setting.benchmark)
    for entry, names in benchmarks.items():
        if entry.external and entry.metric not in registry.metrics():
            continue
        options = dict(entry.options)
        cls = registry.get(entry.metric).cls
        config = build_config(cls.Config, options, entry.metric)
        assert {k: getattr(config, k) for k in options} == options, entry.id
        if entry.blocked:
            continue
        built = [capeval_plugins.load(entry.metric, **options)] + [rp.build(entry, b, []) for b in sorted(names)]
        for metric in built:
            assert {k: getattr(metric.config, k) for k in options} == options, entry.id
    pp = next(e for e in benchmarks if e.id == "pacscore_pp")
    assert rp.build(pp, "composite", []).checkpoint().endswith("pacs_pp-vit-b-32")


def test_parse_column():
    assert rp.parse_column("vatex-eval?num_references=9:kendall_tau_b") == (
        rp.Setting("vatex-eval", num_references=9), "kendall_tau_b")
    assert rp.parse_column("caparena/msd-score:system:spearman") == (
        rp.Setting("caparena", "msd-score"), "system:spearman")
    assert rp.parse_column("nebula?labels=original:kendall_tau_c")[0].key == "nebula?labels=original"
    with pytest.raises(ValueError):
        rp.parse_column("nebula?colour=red:kendall_tau_c")


def test_dry_run_lists_every_pair_and_what_it_needs(offline_cache, capsys, tmp_path):
    """--dry-run: every (entry, benchmark) pair with its published values and sources, what it needs, and why it
    cannot run here: offline with an empty cache nothing runs; a metric not registered says so."""
    out = tmp_path / "plan.json"
    assert main(["reproduce", "--dry-run", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    pairs = json.loads(out.read_text())["pairs"]
    assert len(pairs) == len(rp.select(rp.load_published()))
    assert "[rigel-t1] Rigel (Koyama et al., arXiv:2606.29997, 2026), Table 1" in printed
    installed = set(registry.metrics())
    for pair in pairs:
        assert pair["published"] and not pair["runnable"]
        if pair["metric"] not in installed:
            assert pair["problem"].startswith(f"metric {pair['metric']} not installed")
    vela = [p for p in pairs if p["metric"] == "vela"]
    assert len(vela) == 6 and all(p["problem"] and "vela" in p["problem"].lower() for p in vela), vela[0]
    bleu = next(p for p in pairs if p["entry"] == "bleu4" and p["setting"] == "flickr8k-expert")
    assert bleu["data"] == "fetch: yuwd/Flickr8k-HumanEval" and "HF_HUB_OFFLINE=1" in bleu["problem"]
    assert {"statistic": "kendall_tau_c", "value": 30.8, "source": "rigel-t1"} in bleu["published"]
    pascal = next(p for p in pairs if p["entry"] == "bleu4" and p["setting"] == "pascal50s")
    assert "--data pascal50s=PATH" in pascal["problem"]
    fleur = next(p for p in pairs if p["entry"] == "fleur" and p["setting"] == "composite")
    assert fleur["gpu"] and fleur["weights"] == ["llava-hf/llava-1.5-13b-hf"]


def test_judging_within_the_papers_rounding():
    entry = rp.Entry("bleu4", "bleu4", "BLEU-4")
    setting = rp.Setting("flickr8k-cf")
    values = [rp.Value(entry, setting, "kendall_tau_b", 16.4, 1, "rigel-t1"),
              rp.Value(entry, setting, "kendall_tau_b", 16.9, 1, "discode-t3")]
    for measured, status in ((16.449, "reproduced"), (16.851, "reproduced"), (16.65, "not reproduced"),
                             (16.3501, "reproduced")):
        row = rp.Row(entry, setting, "kendall_tau_b", values)
        rp._judge(row, SimpleNamespace(stats={"kendall_tau_b": measured}, system_stats={}), None)
        assert row.status == status, (measured, row.reason)
    row = rp.Row(entry, setting, "kendall_tau_b", values)
    rp._judge(row, SimpleNamespace(stats={"kendall_tau_b": 16.9}, system_stats={}), None)
    assert "not 16.4 [rigel-t1]" in row.reason
    two = rp.Row(entry, setting, "kendall_tau_c", [rp.Value(entry, setting, "kendall_tau_c", 56.43, 2, "x")])
    rp._judge(two, SimpleNamespace(stats={"kendall_tau_c": 56.44}, system_stats={}), None)
    assert two.status == "not reproduced" and two.reason == "+0.01 from [x]"
    system = rp.Row(entry, setting, "system:spearman", [rp.Value(entry, setting, "system:spearman", 42.4, 1, "x")])
    rp._judge(system, SimpleNamespace(stats={}, system_stats={"spearman": 42.42}), None)
    assert system.status == "reproduced"


def test_head_keeps_the_first_rows_and_pairs():
    captions = Captions(["a", "a", "b", "b", "c", "c"], ["1", "2", "3", "4", "5", "6"], [["r"]] * 6)
    pairs = Pairs(captions, first=[4, 0, 2], second=[5, 1, 3], label=[1, 0, 1], categories=["x", "y", "x"])
    small = rp.head(pairs, 2)
    assert len(small) == 2 and small.categories == ["x", "y"] and small.label.tolist() == [1, 0]
    assert [(small.captions.candidates[f], small.captions.candidates[s]) for f, s in zip(small.first, small.second)] \
        == [("5", "6"), ("1", "2")]
    ratings = Ratings(captions, np.arange(6.0), categories=list("uvwxyz"))
    few = rp.head(ratings, 3)
    assert few.captions.candidates == ["1", "2", "3"] and few.human.tolist() == [0, 1, 2]
    assert few.categories == list("uvw")


def flickr_file(path: Path, images: int = 8) -> tuple[list[str], list[float]]:
    """A CLIPScore-layout file: 3 ratings per caption, 2 captions per image; the captions and ratings in row order."""
    rng = np.random.default_rng(3)
    data, captions, ratings = {}, [], []
    for i in range(images):
        judged = []
        for j in range(2):
            caption = f"picture {i} caption {j}"
            for _ in range(3):
                rating = float(rng.integers(1, 5))
                judged.append({"caption": caption, "rating": rating, "image_path": f"{i}.jpg"})
                captions.append(caption)
                ratings.append(rating)
        data[str(i)] = {"ground_truth": [f"reference {i}", "another reference"], "human_judgement": judged}
    path.write_text(json.dumps(data))
    return captions, ratings


def test_a_pair_from_released_scores_and_a_smoke_pass(offline_cache, capsys, tmp_path):
    """--scores ENTRY:BENCH=FILE runs that pair from the file (FLEUR's released outputs are this case): the
    measured tau-c is scipy's on the benchmark's rows; --limit runs a smoke pass that compares nothing."""
    data = tmp_path / "flickr8k.json"
    captions, ratings = flickr_file(data)
    distinct = list(dict.fromkeys(captions))
    score = {c: float((k * 7) % 5) for k, c in enumerate(distinct)}
    scores = tmp_path / "fleur.jsonl"
    scores.write_text("".join(json.dumps({"image": f"{c.split()[1]}.jpg", "caption": c, "score": s}) + "\n"
                              for c, s in score.items()))
    out = tmp_path / "out.json"
    args = ["reproduce", "--metric", "fleur", "--benchmark", "flickr8k-expert", "--data", f"flickr8k-expert={data}",
            "--scores", f"fleur:flickr8k-expert={scores}", "--no-cache", "--quiet", "--json", str(out)]
    assert main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    fleur = next(r for r in rows if r["entry"] == "fleur")
    expected = 100 * kendalltau([score[c] for c in captions], ratings, variant="c")[0]
    assert fleur["measured"] == pytest.approx(expected, abs=1e-4)
    assert fleur["status"] == ("reproduced" if abs(expected - 53.0) <= 0.05 else "not reproduced")
    others = [r for r in rows if r["entry"] != "fleur"]
    assert others and all(r["status"] == "not runnable here" for r in others)  # RefFLEUR, FLEUR-LV, ...: no file

    assert main([*args, "--limit", "12"]) == 0
    fleur = next(r for r in json.loads(out.read_text())["rows"] if r["entry"] == "fleur")
    assert fleur["status"] == "smoke pass (--limit 12), not compared"
    assert fleur["measured"] == pytest.approx(100 * kendalltau([score[c] for c in captions[:12]], ratings[:12],
                                                               variant="c")[0], abs=1e-4)
    assert "smoke pass" in capsys.readouterr().out


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="the classic metrics' PTB tokenizer needs Java")
def test_text_rows_reproduce_on_flickr8k_expert(offline_cache, tmp_path):
    """On the real Flickr8k-Expert file, BLEU-1, BLEU-4, ROUGE-L and CIDEr reproduce every published tau-b and
    tau-c within the papers' rounding (METEOR and SPICE are left out to keep the test short: METEOR reproduces
    too, see benchmarks/README.md; SPICE needs Stanford CoreNLP's jars)."""
    expert = Path(os.environ.get("CAPEVAL_BENCHDATA", BENCHDATA)) / "flickr8k_expert" / "flickr8k.json"
    if not expert.is_file():
        pytest.skip(f"Flickr8k-Expert is not at {expert}")
    out = tmp_path / "out.json"
    metrics = [a for m in ("bleu1", "bleu4", "rouge_l", "cider") for a in ("--metric", m)]
    assert main(["reproduce", *metrics, "--benchmark", "flickr8k-expert", "--data", f"flickr8k-expert={expert}",
                 "--no-cache", "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8
    assert all(r["status"] == "reproduced" for r in rows), [(r["entry"], r["statistic"], r["measured"]) for r in rows]
