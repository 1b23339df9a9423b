"""``capeval verify``: a user's results against the user's expected values, each within a tolerance (the leaf's
own, the run's, else half a unit of the expected value's last digit), every value reported, exit code 3 when
one is outside or missing."""
from __future__ import annotations

import json

import pytest
from conftest import capeval_in_process

from capeval_plugins.bench.verify import default_tolerance, verify
from capeval_plugins.inputs import InputError

REPORT = {"benchmark": "nebula", "results": {"cider": {"kendall_tau_c": 43.94, "n": 5664, "ci95": None},
                                             "mine": {"kendall_tau_c": 51.0}}}


@pytest.mark.parametrize("value, tolerance", [(43.9, 0.05), (44, 0.5), (0.912, 0.0005), (5664, 0.5), (1e-05, 5e-06)])
def test_default_tolerance_is_half_the_last_written_digit(value, tolerance):
    assert default_tolerance(value) == pytest.approx(tolerance, rel=1e-12)


def test_each_value_is_within_or_outside_its_tolerance():
    checks = verify(REPORT, {"results": {"cider": {"kendall_tau_c": 43.9, "n": 5664},
                                         "mine": {"kendall_tau_c": {"value": 51.2, "tolerance": 0.3}}}})
    assert [(c.path, c.status) for c in checks] == [("results.cider.kendall_tau_c", "ok"), ("results.cider.n", "ok"),
                                                    ("results.mine.kendall_tau_c", "ok")]
    # 43.94 is 0.04 from 43.9 (within its 0.05), 0.14 from 43.8
    assert verify(REPORT, {"results": {"cider": {"kendall_tau_c": 43.8}}})[0].status == "outside"
    # a tolerance for the whole check; a leaf's own wins over it
    assert verify(REPORT, {"results": {"cider": {"kendall_tau_c": 43.8}}}, tolerance=0.2)[0].status == "ok"
    own = {"results": {"cider": {"kendall_tau_c": {"value": 43.8, "tolerance": 0.01}}}}
    assert verify(REPORT, own, tolerance=0.2)[0].status == "outside"


def test_a_value_absent_null_or_not_a_number_is_missing():
    checks = verify(REPORT, {"results": {"cider": {"ci95": 1.0, "spearman": 2.0}, "theirs": {"x": 1}},
                             "benchmark": {"n": 3}})
    assert [c.status for c in checks] == ["missing"] * 4


@pytest.mark.parametrize("expected, message", [
    ({"results": {"cider": {"kendall_tau_c": "43.9"}}}, "results.cider.kendall_tau_c must be a finite number"),
    ({"results": {"cider": {"kendall_tau_c": True}}}, "must be a finite number"),
    ({"results": {"cider": {"kendall_tau_c": float("nan")}}}, "must be a finite number"),
    ({"results": {"cider": {"kendall_tau_c": {"value": 1.0, "tolerance": -1}}}}, "tolerance must be >= 0"),
    ({}, "expected values are a JSON object"),
])
def test_bad_expected_values_are_refused_in_one_line(expected, message):
    with pytest.raises(InputError, match=message):
        verify(REPORT, expected)


def test_capeval_verify_prints_every_check_and_exits_3_when_one_fails(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps(REPORT))
    (tmp_path / "expected.json").write_text(json.dumps({"results": {"cider": {"kendall_tau_c": 43.9}}}))
    ok = capeval_in_process(["verify", str(tmp_path / "report.json"), "--expected", str(tmp_path / "expected.json"),
                             "--json", str(tmp_path / "checks.json")])
    assert ok.returncode == 0, ok.stderr
    assert "| results.cider.kendall_tau_c | 43.9 | 43.94 | +0.04 | 0.05 | ok |" in ok.stdout
    assert json.loads((tmp_path / "checks.json").read_text())["checks"][0]["status"] == "ok"
    bad = capeval_in_process(["verify", str(tmp_path / "report.json"), "--expected",
                              '{"results": {"cider": {"kendall_tau_c": 40}, "gone": {"kendall_tau_c": 1}}}'])
    assert bad.returncode == 3 and "0 of 2 within tolerance; 1 outside, 1 missing" in bad.stdout


def test_a_summary_line_of_capeval_score_is_read(tmp_path):
    (tmp_path / "out.txt").write_text("some log line\n" + json.dumps({"n": 3, "metrics": {"cider": {"score": 0.9123}}})
                                      + "\n")
    proc = capeval_in_process(["verify", str(tmp_path / "out.txt"), "--expected",
                               '{"metrics": {"cider": {"score": 0.912}}}'])
    assert proc.returncode == 0 and "| metrics.cider.score | 0.912 | 0.9123 |" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["missing.json", "--expected", "{}"], "missing.json"),
    (["report.json", "--expected", "{not json"], "--expected: not valid JSON"),
    (["report.json", "--expected", "{}", "--tolerance", "-1"], "tolerance must be a finite number >= 0"),
])
def test_unreadable_input_is_exit_2_in_one_line(tmp_path, args, message):
    (tmp_path / "report.json").write_text(json.dumps(REPORT))
    proc = capeval_in_process(["verify", *args], cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
