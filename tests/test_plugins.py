"""A third-party package that declares the entry point shows up everywhere, with no code of ours changed."""
from __future__ import annotations

import json
import textwrap

from conftest import PYTHON, run

PLUGIN = '''
import torch
from capeval_plugins.contract import Batch, MetricInfo, PointwiseMetric
from capeval_plugins.registry import hookimpl


class CaptionLength(PointwiseMetric):
    """Text-only toy metric: number of words in the caption."""

    info = MetricInfo(name="caption_length", display_name="CaptionLength", description="Words per caption.",
                      citation="@misc{length}", references="never", images="never")

    def score(self, batch: Batch):
        return {"score": torch.tensor([float(len(c.split())) for c in batch.candidates], dtype=torch.float64)}


@hookimpl
def capeval_metrics():
    return [CaptionLength]
'''

CHECK = '''
import json, warnings
warnings.simplefilter("ignore")
report = {}
import capeval_plugins
report["listed"] = "caption_length" in [m.name for m in capeval_plugins.list_metrics()]
from capeval_plugins import registry
report["plugin"] = [registry.get("caption_length").plugin, registry.get("caption_length").distribution]

import evaluate
report["evaluate"] = evaluate.load("caption_length").compute(predictions=["a b c", "d e"])["scores"]

from capeval_plugins.torchmetrics import CaptionLength
tm = CaptionLength()
tm.update(captions=["a b c", "d e"])
report["torchmetrics"] = float(tm.compute())

from capeval_plugins.pycocoevalcap import CaptionLength as Scorer
as_written = lambda *texts: {i + 1: [{"caption": t}] for i, t in enumerate(texts)}  # COCO's form, before PTB
report["pycocoevalcap"] = list(Scorer().compute_score(as_written("r", "r"), as_written("a b c", "d e"))[1])

from capeval_plugins.adapters import lm_eval as adapter
import lm_eval.api.registry as reg
adapter.register()
report["lm_eval"] = reg.get_aggregation("capeval/caption_length")(  # per document: {name: item, name_n_skipped: ...}
    [reg.get_metric("caption_length")(references=["r"], predictions=["a b c"])["caption_length"],
     reg.get_metric("caption_length")(references=["r"], predictions=["d e"])["caption_length"]])
print(json.dumps(report))
'''


def install_plugin(site):
    """What pip would leave behind: the module and a dist-info with the entry point."""
    (site / "thirdparty_metric").mkdir(parents=True)
    (site / "thirdparty_metric" / "__init__.py").write_text(PLUGIN)
    info = site / "thirdparty_metric-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-metric\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[capeval_plugins]\nlength = thirdparty_metric\n")
    (info / "RECORD").write_text("")


def test_third_party_metric_in_all_four_ecosystems_and_the_cli(tmp_path):
    install_plugin(tmp_path / "site")
    env = {"PYTHONPATH": str(tmp_path / "site")}
    (tmp_path / "check.py").write_text(textwrap.dedent(CHECK))
    report = json.loads(run([PYTHON, str(tmp_path / "check.py")], env=env, cwd=str(tmp_path)).stdout.splitlines()[-1])
    assert report["listed"] and report["plugin"] == ["length", "thirdparty-metric"]
    assert report["evaluate"] == [3.0, 2.0]
    assert report["torchmetrics"] == 2.5
    assert report["pycocoevalcap"] == [3.0, 2.0]
    assert report["lm_eval"] == 2.5
    listing = run([PYTHON, "-m", "capeval_plugins.cli", "list"], env=env).stdout
    assert "caption_length" in listing and "thirdparty-metric:length" in listing


def test_a_broken_plugin_is_reported_not_fatal(tmp_path):
    site = tmp_path / "site"
    install_plugin(site)
    (site / "thirdparty_metric" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    proc = run([PYTHON, "-c", "import capeval_plugins; print([m.name for m in capeval_plugins.list_metrics()])"],
               env={"PYTHONPATH": str(site)})
    assert "clipscore" in proc.stdout and "broken on purpose" in proc.stderr
