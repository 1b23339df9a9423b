"""Weighted fusion and the simplex grid calibration: known weights recovered, the search equal to a plain loop
over the grid with scipy's Kendall tau, and the ``capeval calibrate`` command."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy.stats import kendalltau

from test_redemption import folder, models  # noqa: F401  (tiny models and pre-generated images)

from capeval_plugins import cli
from capeval_plugins.core.fusion import calibrate, fuse, simplex_grid


def test_simplex_grid_is_every_weight_vector_on_the_lattice():
    grid = simplex_grid(3, 0.02)
    assert grid.shape == (math.comb(50 + 2, 2), 3) == (1326, 3)
    assert np.allclose(grid.sum(axis=1), 1.0) and (grid >= 0).all()
    assert len({tuple(np.round(row * 50).astype(int)) for row in grid}) == len(grid)
    plain = [w for w in itertools.product(range(51), repeat=3) if sum(w) == 50]
    assert sorted(map(tuple, np.round(grid * 50).astype(int).tolist())) == sorted(plain)
    assert simplex_grid(1, 0.1).tolist() == [[1.0]]
    assert simplex_grid(4, 0.25).shape == (math.comb(4 + 3, 3), 4)
    with pytest.raises(ValueError, match="whole number"):
        simplex_grid(3, 0.03)


def test_fuse_is_the_weighted_sum():
    rng = np.random.default_rng(0)
    comps = rng.random((20, 3))
    assert fuse(comps, [0.84, 0.08, 0.08]) == pytest.approx(0.84 * comps[:, 0] + 0.08 * comps[:, 1] + 0.08 * comps[:, 2])
    with pytest.raises(ValueError, match=r"\(N, 2\)"):
        fuse(comps, [0.5, 0.5])


@pytest.mark.parametrize("truth", [(0.84, 0.08, 0.08), (0.2, 0.5, 0.3), (0.0, 0.36, 0.64)])
def test_recovers_the_weights_of_ratings_that_are_an_exact_mix(truth):
    rng = np.random.default_rng(1)
    comps = {"mid": rng.normal(size=400), "dino": rng.uniform(size=400), "bertscore": rng.beta(2, 5, size=400)}
    human = fuse(np.column_stack(list(comps.values())), truth)
    result = calibrate(comps, human)
    assert tuple(result.weights.values()) == pytest.approx(truth, abs=1e-9)
    assert list(result.weights) == ["mid", "dino", "bertscore"]
    assert result.correlation == pytest.approx(1.0) and result.n_best == 1 and result.n_grid == 1326


def test_recovers_weights_from_coarse_noisy_ratings():
    """Likert-like ratings (4 levels, ties everywhere) of a noisy mix: the best weights land near the truth."""
    rng = np.random.default_rng(2)
    comps = rng.normal(size=(3000, 3)) * [1.0, 2.0, 0.5]
    latent = fuse(comps, [0.5, 0.2, 0.3]) + 0.2 * rng.normal(size=3000)
    human = np.digitize(latent, np.quantile(latent, [0.25, 0.5, 0.75])) + 1.0
    result = calibrate(comps, human, names=["a", "b", "c"])
    assert np.abs(np.array(list(result.weights.values())) - [0.5, 0.2, 0.3]).max() <= 0.04
    assert result.correlation == pytest.approx(kendalltau(result.scores, human, variant="c").statistic, abs=1e-12)


@pytest.mark.parametrize("variant", ["c", "b"])
def test_the_search_equals_a_plain_loop_with_scipy(variant):
    rng = np.random.default_rng(3)
    comps = np.round(rng.random((60, 3)), 2)  # ties inside components too
    human = rng.integers(1, 5, size=60).astype(float)
    result = calibrate(comps, human, step=0.1, variant=variant)
    best_tau = -np.inf
    for units in itertools.product(range(11), repeat=3):
        if sum(units) != 10:
            continue
        w = np.array(units) / 10
        tau = kendalltau(comps @ w, human, variant=variant).statistic
        if tau > best_tau + 1e-12:
            best_tau = tau
    assert result.correlation == pytest.approx(best_tau, abs=1e-12)
    assert kendalltau(fuse(comps, list(result.weights.values())), human, variant=variant).statistic == pytest.approx(
        best_tau, abs=1e-12)


def test_bad_inputs_are_refused_with_the_sample():
    comps = np.ones((5, 2))
    comps[3, 1] = np.nan
    with pytest.raises(ValueError, match="sample 3: non-finite"):
        calibrate(comps, np.arange(5.0))
    with pytest.raises(ValueError, match="got 4 ratings for 5 samples"):
        calibrate(np.ones((5, 2)), np.arange(4.0))
    with pytest.raises(ValueError, match="undefined"):
        calibrate(np.random.default_rng(0).random((5, 2)), np.ones(5))


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_calibrate_command_recovers_weights_from_score_and_rating_files(tmp_path, capsys):
    rng = np.random.default_rng(4)
    n = 300
    comps = {"mid_normalized": rng.random(n), "dino_normalized": rng.random(n), "bertscore_normalized": rng.random(n)}
    human = fuse(np.column_stack(list(comps.values())), [0.7, 0.1, 0.2])
    order = rng.permutation(n)  # ratings listed in another order, matched by index
    _write_jsonl(tmp_path / "scores.jsonl", [{"index": i, "score": 0.0, **{k: float(v[i]) for k, v in comps.items()}}
                                             for i in range(n)])
    _write_jsonl(tmp_path / "ratings.jsonl", [{"index": int(i), "human": float(human[i])} for i in order])
    code = cli.main(["calibrate", "--scores", str(tmp_path / "scores.jsonl"), "--ratings", str(tmp_path / "ratings.jsonl"),
                     "--out", str(tmp_path / "weights.json")])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report == json.loads((tmp_path / "weights.json").read_text())
    assert report["weights"] == pytest.approx({"mid_normalized": 0.7, "dino_normalized": 0.1, "bertscore_normalized": 0.2})
    assert report["options"] == ["mid_weight=0.7", "dino_weight=0.1", "bertscore_weight=0.2"]
    assert report["correlation"] == pytest.approx(1.0) and report["variant"] == "c" and report["n_samples"] == n

    csv_path = tmp_path / "all.csv"
    csv_path.write_text("a,b,rating\n" + "".join(f"{comps['mid_normalized'][i]},{comps['dino_normalized'][i]},"
                                                 f"{human[i]}\n" for i in range(n)))
    cli.main(["calibrate", "--scores", str(csv_path), "--components", "a,b", "--rating-key", "rating", "--step",
              "0.1", "--compact"])
    report = json.loads(capsys.readouterr().out)
    assert report["options"] == [] and set(report["weights"]) == {"a", "b"} and report["n_grid"] == 11


def test_calibrate_command_errors_are_one_line(tmp_path, capsys):
    _write_jsonl(tmp_path / "scores.jsonl", [{"index": 0, "mid_normalized": 0.5}])
    code = cli.main(["calibrate", "--scores", str(tmp_path / "scores.jsonl")])
    assert code == 2 and "no column 'dino_normalized'" in capsys.readouterr().err
    _write_jsonl(tmp_path / "scores.jsonl", [{"index": 0, "x": 0.5, "human": 1.0}, {"index": 1, "human": 2.0}])
    code = cli.main(["calibrate", "--scores", str(tmp_path / "scores.jsonl"), "--components", "x"])
    assert code == 2 and "row 2 has no 'x'" in capsys.readouterr().err
    _write_jsonl(tmp_path / "scores.jsonl", [{"a.x": 0.5, "b.x": 0.1, "human": 1.0}])
    code = cli.main(["calibrate", "--scores", str(tmp_path / "scores.jsonl"), "--components", "x"])
    assert code == 2 and "several columns end in 'x' (a.x, b.x)" in capsys.readouterr().err
    _write_jsonl(tmp_path / "a.jsonl", [{"x": 1.0, "human": 1.0}, {"x": 2.0, "human": 2.0}])
    _write_jsonl(tmp_path / "r.jsonl", [{"human": 1.0}])
    code = cli.main(["calibrate", "--scores", str(tmp_path / "a.jsonl"), "--ratings", str(tmp_path / "r.jsonl"),
                     "--components", "x"])
    assert code == 2 and "has 2 rows but" in capsys.readouterr().err


@pytest.mark.slow
def test_score_then_calibrate_then_score_again_from_the_cli_s_own_files(models, folder, tmp_path, capsys):  # noqa: F811
    """The documented pipeline on tiny models: ``capeval score -m redemption_score`` writes its components,
    ``capeval calibrate`` reads that very file and returns options, and those options given back to
    ``capeval score`` fuse the components with the calibrated weights."""
    from conftest import capeval_here
    from test_redemption import corpus

    images, candidates, references = corpus()
    (tmp_path / "images").mkdir()
    rows = []
    for i, (image, caption, refs) in enumerate(zip(images, candidates, references)):
        image.save(tmp_path / "images" / f"{i}.png")
        rows.append({"image": f"images/{i}.png", "caption": caption, "references": refs})
    _write_jsonl(tmp_path / "captions.jsonl", rows)
    def score(out, *options):
        args = ["-o", f"clip_model={models['clip']}", "-o", f"dino_model={models['dino']}", "-o",
                f"generated_images={folder}", "-o", f"bertscore_model={models['deberta_v3']}", "-o",
                "bertscore_num_layers=2", *[a for o in options for a in ("-o", o)]]
        capeval_here(["score", "-m", "redemption_score", *args, "--captions", str(tmp_path / "captions.jsonl"),
                      "--out", str(out), "--quiet"])
        return [json.loads(line) for line in out.read_text().splitlines()]

    first = score(tmp_path / "scores.jsonl")
    names = [f"redemption_score.{k}_normalized" for k in ("mid", "dino", "bertscore")]
    comps = np.array([[row[k] for k in names] for row in first])
    human = fuse(comps, [0.3, 0.2, 0.5]) + np.random.default_rng(0).normal(0, 1e-3, len(first))  # near this fusion
    ratings = [{"index": row["index"], "human": float(h)} for row, h in zip(first, human)]
    _write_jsonl(tmp_path / "ratings.jsonl", ratings)

    code = cli.main(["calibrate", "--scores", str(tmp_path / "scores.jsonl"), "--ratings",
                     str(tmp_path / "ratings.jsonl")])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and list(report["weights"]) == names
    weights = [report["weights"][k] for k in names]
    assert report["correlation"] == pytest.approx(kendalltau(fuse(comps, weights), human, variant="c").statistic,
                                                  abs=1e-12)
    parts = ("mid", "dino", "bertscore")
    assert report["options"] == [f"redemption_score.{k}_weight={w!r}" for k, w in zip(parts, weights)]

    again = score(tmp_path / "again.jsonl", *report["options"])
    assert [row["redemption_score"] for row in again] == pytest.approx(fuse(comps, weights).tolist(), abs=1e-9)


def _points(k: int, units: int) -> int:
    """Weight vectors on the simplex, counted by a plain loop (tiny) or stars and bars (large):
    (units + 1) (units + 2) ... (units + k - 1) / (k - 1)!."""
    if units <= 12 and k <= 4:
        return sum(1 for w in itertools.product(range(units + 1), repeat=k) if sum(w) == units)
    return math.prod(range(units + 1, units + k)) // math.factorial(k - 1)


def _no_grid(*args, **kwargs):
    raise AssertionError("the grid was built")


@pytest.mark.parametrize("k, step, n", [(2, 1e-9, 10), (3, 0.0005, 10), (2, 1e-6, 10), (3, 0.001, 1000),
                                        (3, 0.02, 200_000), (6, 0.01, 10)])
def test_a_grid_or_fused_matrix_past_the_bound_is_refused_before_it_is_built(monkeypatch, k, step, n):
    """--step 1e-9 built a grid of a billion rows, then an (N, M) matrix, and the process was killed for
    memory. Refused now, naming the size, before the grid exists; the step it advises fits, the next finer
    round step does not."""
    from capeval_plugins.core import fusion

    units = round(1 / step)
    points = _points(k, units)
    assert points > fusion.MAX_GRID_POINTS or n * points > fusion.MAX_FUSED_SCORES
    monkeypatch.setattr(fusion, "simplex_grid", _no_grid)
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError) as refused:
        fusion.calibrate(rng.random((n, k)), rng.random(n), step=step)
    said = str(refused.value)
    assert (f"{points:,} weight vectors" in said) and "\n" not in said, said
    advised = float(said.rsplit("the finest step that fits is ", 1)[1])
    fine_units = round(1 / advised)
    assert _points(k, fine_units) <= fusion.MAX_GRID_POINTS and n * _points(k, fine_units) <= fusion.MAX_FUSED_SCORES
    finer = fine_units * {"1": 2, "2": 5, "5": 2}[str(fine_units)[0]] // {"1": 1, "2": 2, "5": 1}[str(fine_units)[0]]
    assert _points(k, finer) > fusion.MAX_GRID_POINTS or n * _points(k, finer) > fusion.MAX_FUSED_SCORES


def test_the_largest_grid_within_the_bound_is_still_searched():
    from capeval_plugins.core import fusion

    assert len(simplex_grid(2, 1 / (fusion.MAX_GRID_POINTS - 1))) == fusion.MAX_GRID_POINTS
    with pytest.raises(ValueError, match="1,000,001 weight vectors"):
        simplex_grid(2, 1 / fusion.MAX_GRID_POINTS)


def test_calibrate_refuses_a_step_too_fine_in_one_line(tmp_path, capsys, monkeypatch):
    from capeval_plugins.core import fusion

    monkeypatch.setattr(fusion, "simplex_grid", _no_grid)  # the old code went on to build it: killed, no message
    _write_jsonl(tmp_path / "s.jsonl", [{"a": i / 7, "b": (i * 3 % 7) / 7, "human": i % 3} for i in range(7)])
    code = cli.main(["calibrate", "--scores", str(tmp_path / "s.jsonl"), "--rating-key", "human", "--components",
                     "a,b", "--step", "1e-9"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "step 1e-09 makes a grid of 1,000,000,001 weight vectors for 2 components" in err
    assert "the finest step that fits is 2e-06" in err


@pytest.mark.parametrize("bad, said", [(True, "'a' True is not a number"), ("0.5", "'a' '0.5' is text, not a number"),
                                       ([0.5], "'a' [0.5] is not a number")])
@pytest.mark.parametrize("column", ["a", "human"])
def test_a_component_or_rating_that_is_not_a_number_is_refused_by_its_row(tmp_path, capsys, bad, said, column):
    """JSON ``true`` was read as 1.0 and ``"0.5"`` as 0.5 without a word; ``capeval bench --scores`` refuses
    booleans, and calibrate now says the row too (a CSV cell is text, and a number there)."""
    rows = [{"a": 0.1, "b": 0.2, "human": 1}, {"a": 0.2, "b": 0.3, "human": 2}, {"a": 0.3, "b": 0.1, "human": 3}]
    rows[1][column] = bad
    _write_jsonl(tmp_path / "s.jsonl", rows)
    code = cli.main(["calibrate", "--scores", str(tmp_path / "s.jsonl"), "--components", "a,b"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"s.jsonl: row 2: {said}".replace("'a'", repr(column)) in err, err
