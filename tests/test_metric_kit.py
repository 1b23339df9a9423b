"""The metric test kit (``capeval_plugins.testing.kit``, docs/adding-a-metric.md): it passes on the package's own
metrics and on every installed plugin's metric that declares a tiny recipe; each check catches the broken metric it
claims to (a score that depends on its batch, a metric that remembers what it mapped, a blank caption that is not
scored, rows out of order, a card that lacks a section, options an entry point cannot rebuild); and a plugin
installed beside the package with pip leaves the package's own suite green. The guide shows the example plugin's
files (examples/plugin/) as they are."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import types
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass

import pytest
import torch
from conftest import HANG_GUARD, PYTHON, ROOT, declared_recipe, run, third_party_metrics
from test_lvlm import scripted_llava
from test_plugins import PLUGIN
from test_resume_every_metric import EXPERT_JUDGE

import capeval_plugins
from capeval_plugins import registry
from capeval_plugins.contract import Batch, MetricConfig, MetricInfo, PointwiseMetric
from capeval_plugins.testing import kit, tiny_checkpoint

# ---------------------------------------------------------------------------------------------------------
# The kit on the package's own metrics (text metrics without Java, and models of every kind on tiny checkpoints)


class TestKitOnBleu4(kit.MetricTests):
    factory = staticmethod(lambda **o: capeval_plugins.load("bleu4", tokenize=False, **o))


class TestKitOnCider(kit.MetricTests):
    factory = staticmethod(lambda **o: capeval_plugins.load("cider", tokenize=False, **o))


class TestKitOnClipscore(kit.MetricTests):
    factory = staticmethod(lambda **o: capeval_plugins.load("clipscore", model=str(tiny_checkpoint("clip")), **o))


# BERTScore (RoBERTa's leading space), VELA's regressor and EXPERT's generating judge: a text-encoder metric whose
# evaluate name is only "capeval/bertscore", a learned head, and an LVLM that writes its answer.
class TestKitOnBertscore(kit.MetricTests):
    factory = staticmethod(lambda **o: capeval_plugins.load("bertscore", model=str(tiny_checkpoint("roberta")), **o))


class TestKitOnVela(kit.MetricTests):
    factory = staticmethod(lambda **o: capeval_plugins.load("vela", model=str(tiny_checkpoint("vela")), **o))


class TestKitOnExpert(kit.MetricTests):
    factory = staticmethod(lambda **o: capeval_plugins.load("expert", model=scripted_llava(EXPERT_JUDGE),
                                                            max_new_tokens=8, **o))


# The suite checks the cards of the package's own metrics (tests/test_docs.py), not a plugin's.
PLUGIN_CHECKS = [check for check in kit.CHECKS if check != "card"]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", third_party_metrics() or ["no-plugin-installed"])
def test_the_kit_passes_on_every_installed_plugin_metric(name):
    if name not in registry.metrics():
        pytest.skip("no third-party metric is installed beside the package")
    recipe, cls = declared_recipe(name), registry.get(name).cls
    kit.check_metric(lambda **overrides: cls(**{**recipe, **overrides}), checks=PLUGIN_CHECKS)


# ---------------------------------------------------------------------------------------------------------
# Broken metrics: each check catches the fault it is there for


def words(captions: list[str]) -> torch.Tensor:
    return torch.tensor([float(len(c.split())) for c in captions], dtype=torch.float64)


def info(name: str, **fields) -> MetricInfo:
    return MetricInfo(name=name, display_name=name.title().replace("_", ""), description="Words per caption.",
                      citation="-", references="never", images="never", **fields)


class Words(PointwiseMetric):
    info = info("kit_words", score_range=(0.0, 100.0))

    def score(self, batch: Batch):
        return {"score": words(batch.candidates)}


class BatchCentred(Words):
    """Words minus the batch's mean: a score that depends on the other samples of its batch."""

    info = info("kit_batch_centred")

    def score(self, batch: Batch):
        n = words(batch.candidates)
        return {"score": n - n.mean()}


class FirstSeen(Words):
    """Words plus the id of the first sample this instance ever mapped: a metric that remembers."""

    info = info("kit_first_seen")
    first: float | None = None

    def score(self, batch: Batch):
        if self.first is None:
            self.first = float(batch.indices[0])
        return {"score": words(batch.candidates) + self.first}


class WordsPerCharacter(Words):
    """0 / 0 for an empty caption: a NaN where an answer must get a number."""

    info = info("kit_words_per_character")

    def score(self, batch: Batch):
        return {"score": words(batch.candidates) / torch.tensor([float(len(c)) for c in batch.candidates])}


class SortedRows(Words):
    """Rows sorted by score, not in the batch's order: every score filed under another sample."""

    info = info("kit_sorted_rows")

    def score(self, batch: Batch):
        return {"score": words(batch.candidates).sort().values}


@dataclass
class ScaledConfig(MetricConfig):
    scale: float = 1.0


class Scaled(Words):
    """Words times ``scale``; configured outside its options by the factory below, which no entry point that
    builds a metric by name can rebuild."""

    info = info("kit_scaled")
    Config = ScaledConfig

    @classmethod
    def tiny_recipe(cls):
        return {"scale": 3.0}

    def score(self, batch: Batch):
        return {"score": self.config.scale * words(batch.candidates) + getattr(self, "offset", 0.0)}


def with_offset(**options) -> Scaled:
    metric = Scaled(**options)
    metric.offset = 1.0  # a setting that is not an option
    return metric


TEXTS = kit.sample_corpus(Words.info)


def test_the_text_metric_without_faults_passes_every_check_but_the_card():
    report = kit.check_metric(Words, TEXTS, checks=[c for c in kit.CHECKS if c != "card"])
    assert report["batch_split"] == report["ddp_merge"] == report["resume"] == "passed"
    assert report["evaluate"] == "skipped: kit_words is not registered: evaluate loads metrics by name"


def test_batch_split_catches_a_score_that_depends_on_its_batch():
    with pytest.raises(kit.KitFailure, match="kit_batch_centred: batch_size=1 vs the default: per-sample scores"):
        kit.check_batch_split(BatchCentred, TEXTS)


def test_ddp_merge_and_resume_catch_a_metric_that_remembers_what_it_mapped():
    kit.check_batch_split(FirstSeen, TEXTS)  # every single pass starts with sample 0: the fault is invisible here
    with pytest.raises(kit.KitFailure, match=r"2 ranks: merged state 'score' \(cat\) differs"):
        kit.check_ddp_merge(FirstSeen, TEXTS)
    with pytest.raises(kit.KitFailure, match="resumed run vs uninterrupted run: per-sample scores differ"):
        kit.check_resume(FirstSeen, TEXTS)


def test_ddp_merge_allows_floating_sums_added_in_another_order_and_nothing_more():
    """A sum of thirds added per rank then across ranks differs from one process's in its last bits: within the
    rounding bound. The bound is not slack: a sum off by one ulp more than it allows is refused."""
    from capeval_plugins.contract import StateSpec, merge_states

    spec = {"total": StateSpec("sum", torch.float64)}
    parts = [{"total": torch.tensor(v / 3, dtype=torch.float64)} for v in (1.0, 1e8, 7.0, 1e-3, 5.0, 11.0)]
    one = merge_states(spec, parts)
    ranked = merge_states(spec, [merge_states(spec, parts[:2]), merge_states(spec, parts[2:])])
    kit._compare_states(spec, ranked, one, parts, "2 ranks")
    bound = 2 * len(parts) * torch.finfo(torch.float64).eps * sum(abs(p["total"]) for p in parts)
    with pytest.raises(kit.KitFailure, match="merged state 'total' \\(sum\\) differs"):
        kit._compare_states(spec, {"total": one["total"] + 2 * bound}, one, parts, "2 ranks")


def test_empty_captions_catches_a_blank_caption_without_a_number():
    with pytest.raises(kit.KitFailure, match="kit_words_per_character: scores with blank captions are not all finite"):
        kit.check_empty_captions(WordsPerCharacter, TEXTS)


def test_row_order_catches_rows_out_of_their_batch_order():
    with pytest.raises(kit.KitFailure, match="kit_sorted_rows.map returned the rows of state 'score' in another order"):
        kit.check_row_order(SortedRows, TEXTS)


def test_the_card_check_catches_no_card_and_a_card_path_that_is_not_a_file():
    with pytest.raises(kit.KitFailure, match="kit_words: no card"):
        kit.check_card(Words)
    misnamed = type("Misnamed", (Words,), {"card": "word_precision/README.md"})  # taken as the card's text
    with pytest.raises(kit.KitFailure, match="card lacks '## Metric Description'"):
        kit.check_card(misnamed)


@pytest.fixture
def registered():
    """Register metric classes for one test (as an installed plugin would), then forget them."""
    manager, names = registry.plugin_manager(), []

    def add(*classes) -> None:
        plugin = types.ModuleType(f"kit_test_plugin_{len(names)}")
        plugin.capeval_metrics = registry.hookimpl(lambda: list(classes))
        names.append(plugin.__name__)
        registry.register_plugin(plugin, name=plugin.__name__)

    yield add
    for name in names:
        manager.unregister(name=name)
    registry.refresh()


@pytest.mark.filterwarnings("ignore")
def test_the_ecosystem_checks_catch_a_setting_an_entry_point_cannot_rebuild(registered):
    """The metric's options reach evaluate and lm-eval by name (the recipe's scale = 3 arrives), but a setting made
    outside the options does not: those two checks fail, the torchmetrics one (given the built metric) passes."""
    registered(Scaled)
    kit.check_evaluate(Scaled, TEXTS)
    kit.check_lm_eval(Scaled, TEXTS)
    kit.check_torchmetrics(with_offset, TEXTS)
    with pytest.raises(kit.KitFailure, match="kit_scaled: evaluate vs the direct call: per-sample scores differ"):
        kit.check_evaluate(with_offset, TEXTS)
    with pytest.raises(kit.KitFailure, match="kit_scaled: lm-eval's corpus score"):
        kit.check_lm_eval(with_offset, TEXTS)


def test_an_ecosystem_that_is_not_installed_is_skipped_with_its_name(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchmetrics" else real(name, *a))
    with pytest.raises(kit.CheckSkipped, match="torchmetrics is not installed"):
        kit.check_torchmetrics(Words, TEXTS)
    report = kit.check_metric(Words, TEXTS, checks=["torchmetrics", "lm_eval", "pycocoevalcap"])
    assert report == {"torchmetrics": "skipped: torchmetrics is not installed",
                      "lm_eval": "skipped: kit_words is not registered: lm-eval finds metrics by name",
                      "pycocoevalcap": "passed"}


def test_metric_tests_skip_what_does_not_apply_and_fail_what_breaks():
    class TestSorted(kit.MetricTests):
        factory = SortedRows

    with pytest.raises(pytest.skip.Exception, match="not registered"):
        TestSorted().test_evaluate()
    with pytest.raises(kit.KitFailure, match="another order"):
        TestSorted().test_row_order()


def test_a_class_is_built_with_its_tiny_recipe_and_overrides_win():
    assert kit.as_factory(Scaled)().config.scale == 3.0
    assert kit.as_factory(Scaled)(scale=2.0, batch_size=5).config.batch_size == 5
    assert kit.as_factory(Words)().config == Words().config  # no recipe: the defaults


def test_check_metric_lists_every_failed_check():
    with pytest.raises(kit.KitFailure) as failure:
        kit.check_metric(SortedRows, TEXTS, checks=["row_order", "card", "ddp_merge"])
    listed = str(failure.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in listed] == ["row_order", "card", "ddp_merge"]
    assert "kit_sorted_rows: no card" in listed[1] and "RowOrderError" in listed[2]  # the session's own probe


# ---------------------------------------------------------------------------------------------------------
# A plugin installed beside the package (with pip) leaves the package's suite green

NO_RECIPE = PLUGIN  # a third-party metric declaring no tiny recipe (tests/test_plugins.py's)

NO_RECIPE_PROJECT = '''
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "caption-length"
version = "0.1"

[project.entry-points.capeval_plugins]
length = "caption_length"

[tool.hatch.build.targets.wheel]
packages = ["caption_length"]
'''

# (test, its id for each plugin metric): the per-metric tests of the suite that take a third-party metric
PER_METRIC = ["tests/test_empty_captions.py::test_every_metric_scores_an_empty_caption",
              "tests/test_resume_every_metric.py::test_every_plugin_metric_resumes_to_the_same_bits",
              "tests/test_metric_kit.py::test_the_kit_passes_on_every_installed_plugin_metric",
              "tests/test_every_metric_everywhere.py::test_evaluate_torchmetrics_pycocoevalcap_and_lm_eval_know_it"]


@pytest.mark.slow
def test_a_plugin_installed_with_pip_leaves_the_suite_green(tmp_path):
    """examples/plugin (with a tiny recipe) and a plugin without one, built and installed by pip as a user would;
    then the suite's per-metric tests on their metrics, the loops over every metric, and the plugin's own kit tests,
    in a pytest of their own: all green, the plugin with a recipe tested on it, the other skipped saying why."""
    site, sources = tmp_path / "site", tmp_path / "sources"
    shutil.copytree(ROOT / "examples" / "plugin", sources / "word-precision")  # pip may build in the tree
    (sources / "caption-length" / "caption_length").mkdir(parents=True)
    (sources / "caption-length" / "caption_length" / "__init__.py").write_text(NO_RECIPE)
    (sources / "caption-length" / "pyproject.toml").write_text(NO_RECIPE_PROJECT)
    run([PYTHON, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "--target",
         str(site), str(sources / "word-precision"), str(sources / "caption-length")])
    nodes = [f"{test}[{name}]" for test in PER_METRIC for name in ("word_precision", "caption_length")]
    nodes += ["tests/test_preflight.py::test_every_metric_declares_the_models_it_names",
              str(sources / "word-precision" / "tests")]
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                           f"--basetemp={tmp_path / 'inner'}", f"--junitxml={report}", "--rootdir", str(ROOT), *nodes],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        skipped = case.find("skipped")
        outcomes[case.get("name")] = ("skipped", skipped.get("message")) if skipped is not None else ("passed", "")
    for test in PER_METRIC:
        name = test.split("::")[1]
        assert outcomes[f"{name}[word_precision]"][0] == "passed", outcomes
        if "everywhere" in test:  # no model is built: every metric, with or without a recipe
            assert outcomes[f"{name}[caption_length]"][0] == "passed"
        else:
            state, reason = outcomes[f"{name}[caption_length]"]
            assert state == "skipped" and "'caption-length', which declares no tiny recipe" in reason, reason
    kit_tests = [n for n in outcomes if n.startswith("test_") and n in dir(kit.MetricTests)]
    assert sorted(kit_tests) == sorted(n for n in dir(kit.MetricTests) if n.startswith("test_"))
    assert all(outcomes[n][0] == "passed" for n in kit_tests), outcomes  # every ecosystem is installed here
    assert outcomes["test_counts_words_found_in_the_references"][0] == "passed"


# ---------------------------------------------------------------------------------------------------------
# The guide shows the example plugin as it is


def test_the_guide_shows_the_example_plugins_files_as_they_are():
    """Each block of docs/adding-a-metric.md introduced by a file of examples/plugin/ is that file, whole."""
    text = (ROOT / "docs" / "adding-a-metric.md").read_text()
    shown = re.findall(r"`(examples/plugin/[^`]+)`[^`\n]*:\n\n```\w*\n(.*?)^```", text, re.S | re.M)
    assert {path for path, _ in shown} >= {"examples/plugin/word_precision/metric.py",
                                            "examples/plugin/word_precision/capeval_hooks.py",
                                            "examples/plugin/tests/test_word_precision.py"}
    for path, body in shown:
        assert body == (ROOT / path).read_text(), f"the guide's {path} is not the file"
    project = (ROOT / "examples" / "plugin" / "pyproject.toml").read_text()
    fragment = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    for line in fragment.splitlines():
        assert line in project.splitlines(), line


def test_the_guide_names_the_metrics_the_kit_runs_on():
    """docs/adding-a-metric.md lists the package's metrics the kit runs on here: exactly the classes above."""
    guide = (ROOT / "docs" / "adding-a-metric.md").read_text()
    listed = re.search(r"the kit runs there on ([^:]+?)\.\n", " ".join(guide.split("\n   "))).group(1)
    named = {n.strip().lower().replace("-", "") for n in re.split(r",| and ", listed) if n.strip()}
    classes = {n.removeprefix("TestKitOn").lower() for n in globals() if n.startswith("TestKitOn")}
    assert named == classes
