"""`capeval list` names every metric and what it needs without importing a metric, torch or a model library; the
catalog it reads for ours (capeval_plugins/metrics/catalog.json) says what the classes say."""
from __future__ import annotations

import json

import pytest
from conftest import PYTHON, run

from capeval_plugins import metrics, registry

# What listing names and needs must not import: the models' stack, and any metric module (which imports it).
HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "numpy", "PIL", "scipy",
         "capeval_plugins.contract")

LIST_AND_SHOW_MODULES = """
import json, sys
from capeval_plugins import cli
code = cli.main(["list", *sys.argv[1:]])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_list_imports_no_metric_and_no_model_library(flags):
    proc = run([PYTHON, "-c", LIST_AND_SHOW_MODULES, *flags])
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["code"] == 0
    loaded = report["modules"]
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY or m in HEAVY)
    assert heavy == []
    metric_modules = sorted(m for m in loaded if m.startswith("capeval_plugins.metrics."))
    assert metric_modules == []
    listed = proc.stdout
    for entry in registry.metrics():  # every metric is listed all the same
        assert entry in listed


def test_catalog_is_what_the_metric_classes_say():
    """Fails when a metric module changed since tools/metric_catalog.py wrote the catalog: run it again."""
    written = json.loads(metrics.CATALOG.read_text(encoding="utf-8"))
    assert written == metrics.catalog_entries(), "run: python tools/metric_catalog.py"


def test_listing_equals_the_registered_classes():
    listed = {entry.name: entry for entry in registry.listing()}
    classes = registry.metrics()
    assert sorted(listed) == sorted(classes)
    for name, entry in classes.items():
        assert listed[name].row == registry.catalog_row(entry.info), name
        assert (listed[name].plugin, listed[name].distribution) == (entry.plugin, entry.distribution)


def test_a_module_changed_since_the_catalog_is_described_from_its_classes(tmp_path, monkeypatch):
    """A stale entry (its module's source changed) is never shown: that module is imported and described."""
    catalog = json.loads(metrics.CATALOG.read_text(encoding="utf-8"))
    catalog["clipscore"]["metrics"][0]["description"] = "stale"
    catalog["clipscore"]["digest"] = "0" * 32
    catalog["mid"]["metrics"][0]["description"] = "from the catalog"  # its digest still matches: used
    planted = tmp_path / "catalog.json"
    planted.write_text(json.dumps(catalog))
    monkeypatch.setattr(metrics, "CATALOG", planted)
    rows = {row["name"]: row for row in metrics.capeval_metric_catalog()}
    from capeval_plugins.metrics.clipscore import CLIPScore

    assert rows["clipscore"]["description"] == CLIPScore.info.description
    assert rows["mid"]["description"] == "from the catalog"
