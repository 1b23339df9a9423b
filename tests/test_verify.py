"""``capeval verify``: a user's results against the user's expected values, each within a tolerance (the leaf's
own, the run's, else half a unit of the expected value's last digit), every value reported, exit code 3 when
one is outside or missing."""
from __future__ import annotations

import json
from decimal import Decimal
from fractions import Fraction

import pytest
from conftest import capeval_in_process

from capeval_plugins.bench.verify import default_tolerance, verify
from capeval_plugins.inputs import InputError

REPORT = {"benchmark": "nebula", "results": {"cider": {"kendall_tau_c": 43.94, "n": 5664, "ci95": None},
                                             "mine": {"kendall_tau_c": 51.0}}}


@pytest.mark.parametrize("value, tolerance", [(43.9, 0.05), (44, 0.5), (0.912, 0.0005), (5664, 0.5), (1e-05, 5e-06)])
def test_default_tolerance_is_half_the_last_written_digit(value, tolerance):
    assert default_tolerance(value) == pytest.approx(tolerance, rel=1e-12)


def _half_unit(written: str) -> Fraction:
    """Half a unit of the last digit of ``written`` (an independent reading: the characters after the point)."""
    mantissa = written.lower().split("e")[0]
    decimals = len(mantissa.partition(".")[2])
    return Fraction(1, 2 * 10 ** decimals)


@pytest.mark.parametrize("written", ["44", "5664", "44.0", "0.10", "43.90", "0.912", "7"])
def test_the_default_tolerance_counts_the_digits_written_in_an_expected_file(tmp_path, written):
    """An integer (5664) is half a unit, 0.10 is 0.005: the digits of the text, not of a float read from it."""
    (tmp_path / "expected.json").write_text('{"x": %s}' % written)
    (tmp_path / "results.json").write_text('{"x": 1}')
    [check] = verify(tmp_path / "results.json", tmp_path / "expected.json")
    assert Fraction(check.tolerance) == pytest.approx(_half_unit(written), rel=1e-12)
    [from_text] = verify({"x": 1}, '{"x": %s}' % written)  # JSON text too
    assert from_text.tolerance == check.tolerance


def test_integers_given_from_python_or_on_the_command_line_are_half_a_unit(tmp_path):
    """The audit's case: 5664.3 and 44.3 against 5664 and 44 are within 0.5 (the command used 0.05: exit 3)."""
    checks = verify({"n": 5664.3, "tau": 44.3}, {"n": 5664, "tau": 44})
    assert [(c.tolerance, c.status) for c in checks] == [(0.5, "ok"), (0.5, "ok")]
    assert verify({"tau": 44.3}, {"tau": 44.0})[0].status == "outside"  # 44.0 is written with a decimal
    (tmp_path / "r.json").write_text('{"results":{"cider":{"n":5664.3,"kendall_tau_c":44.3}}}')
    proc = capeval_in_process(["verify", str(tmp_path / "r.json"), "--expected",
                               '{"results":{"cider":{"n":5664,"kendall_tau_c":44}}}'])
    assert proc.returncode == 0 and "| results.cider.n | 5664 | 5664.3 | +0.3 | 0.5 | ok |" in proc.stdout, proc.stdout


@pytest.mark.parametrize("expected", ["0.913", "0.912", "0.9135", "0.9115", "44", "43.5", "0.1", "0.2"])
@pytest.mark.parametrize("measured", ["0.9125", "0.91300001", "0.9124999", "44.5", "43.0", "0.15", "0.25"])
def test_the_bound_is_inclusive_and_decided_on_the_written_digits(tmp_path, expected, measured):
    """A difference of exactly half a unit is within, whichever way binary floating point rounds it
    (0.9125 - 0.913 came out outside, 0.9125 - 0.912 inside); compared with exact fractions of the texts."""
    (tmp_path / "e.json").write_text('{"x": %s}' % expected)
    (tmp_path / "m.json").write_text('{"x": %s}' % measured)
    [check] = verify(tmp_path / "m.json", tmp_path / "e.json")
    inside = abs(Fraction(measured) - Fraction(expected)) <= _half_unit(expected)
    assert check.status == ("ok" if inside else "outside")


def test_an_own_tolerance_is_inclusive_too():
    own = {"x": {"value": 0.3, "tolerance": 0.1}}
    assert verify({"x": 0.4}, own)[0].status == "ok"  # 0.4 - 0.3 is 0.10000000000000003 in floats
    assert verify({"x": 0.2}, own)[0].status == "ok"
    assert verify({"x": 0.40001}, own)[0].status == "outside"
    assert verify({"x": Decimal("0.4")}, {"x": Decimal("0.3")}, tolerance=0.1)[0].status == "ok"


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
    ({"results": {"cider": {"kendall_tau_c": 10 ** 400}}}, "must be a finite number"),
    ('{"results": {"cider": {"kendall_tau_c": 1e400}}}', "must be a finite number"),
    ('{"a": 1, "a": 2}', "given twice"),
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
