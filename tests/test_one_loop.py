"""One batch loop: every entry point scores through :meth:`capeval_plugins.session.Session.run`, and no metric's
``map`` runs outside it. Shown two ways: at run time (each entry point called on a small corpus, the session's
loop and the contract's ``map_batch`` watched: every map call happens inside a pass), and in the source (an AST
walk: outside the session package nothing calls a metric's ``map``, ``map_batch``, ``map_part`` or a session's
``feed``, so a second loop cannot be written without this test failing)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import EXAMPLES, capeval_here, has_java

import capeval_plugins
from capeval_plugins.session import loop, mapping

PACKAGE = Path(capeval_plugins.__file__).parent
CAPTIONS = ["a dog runs on the grass", "a cat sits on a mat", "two men play ball", "a red car on a road"]
REFERENCES = [["a dog is running on grass", "the dog runs"], ["a cat on a mat"], ["two men playing with a ball"],
              ["a car that is red", "a red car"]]


@pytest.fixture
def watched(monkeypatch):
    """Every pass the session runs (its plans' names) and every map call, each marked inside a pass or not."""
    passes, maps, inside = [], [], []
    real_run, real_map = loop.Session.run, mapping.map_batch

    def run(self, plans, **kwargs):
        passes.append(sorted(p.name for p in plans))
        inside.append(True)
        try:
            return real_run(self, plans, **kwargs)
        finally:
            inside.pop()

    def map_batch(metric, batch):
        maps.append((metric.info.name, bool(inside)))
        return real_map(metric, batch)

    monkeypatch.setattr(loop.Session, "run", run)
    monkeypatch.setattr(mapping, "map_batch", map_batch)
    return passes, maps


def rouge():
    return capeval_plugins.load("rouge_l", tokenize=False)


def _metric_call():
    rouge()(None, CAPTIONS, REFERENCES)


def _score_many():
    from capeval_plugins import runner

    runner.score_many({"rouge_l": rouge(), "bleu1": capeval_plugins.load("bleu1", tokenize=False)}, None, CAPTIONS,
                      REFERENCES)


def _cli_score(tmp_path):
    capeval_here(["score", "-m", "rouge_l", "-o", "rouge_l.tokenize=false", "--captions",
                  str(EXAMPLES / "captions.jsonl"), "--quiet"])


def _cli_bench(tmp_path):
    rows = [{"imgid": f"{k % 3:04d}", "mt": CAPTIONS[k], "refs": REFERENCES[k], "score": k / 4} for k in range(4)]
    (tmp_path / "nebula.json").write_text(json.dumps(rows))
    capeval_here(["bench", "nebula", "--data", str(tmp_path / "nebula.json"), "-m", "rouge_l", "-m", "bleu1", "-o",
                  "tokenize=false", "--bootstrap", "0", "--no-cache", "--quiet"])


def _torchmetrics():
    from capeval_plugins.torchmetrics import ROUGEL

    metric = ROUGEL(tokenize=False)
    metric.update(None, CAPTIONS[:2], REFERENCES[:2])
    metric(None, CAPTIONS[2:], REFERENCES[2:])  # forward
    metric.compute()


def _evaluate():
    import evaluate

    evaluate.load("rouge_l", tokenize=False).compute(predictions=CAPTIONS, references=REFERENCES)


def _pycocoevalcap():
    from capeval_plugins.adapters.coco_eval_stock import StockCider
    from capeval_plugins.pycocoevalcap import Bleu, RougeL

    gts, res = {i: r for i, r in enumerate(REFERENCES)}, {i: [c] for i, c in enumerate(CAPTIONS)}
    RougeL(tokenize=False).compute_score(gts, res)
    Bleu(4, tokenize=False).compute_score(gts, res)
    StockCider().compute_score(gts, res)  # pycocoevalcap's own name, capeval's implementation


def _lm_eval():
    from capeval_plugins.adapters.lm_eval import CaptionItem, aggregate

    aggregate("rouge_l", [CaptionItem(None, c, r) for c, r in zip(CAPTIONS, REFERENCES)], tokenize=False)


def _harness():  # what lm-eval and lmms-eval tasks score their documents with
    from capeval_plugins.adapters.harness import score_documents

    score_documents({"rouge_l": rouge()}, None, CAPTIONS, REFERENCES, ids=[10, 11, 12, 13])


def _mid_fit(tiny_clip):
    from conftest import random_image

    images = [random_image(i, size=(30 + i % 5, 28)) for i in range(40)]
    capeval_plugins.load("mid", model=tiny_clip).fit_reference(images, [[f"a photo {i}"] for i in range(40)])


ENTRY_POINTS = {
    "Metric.__call__": (_metric_call, [["rouge_l"]]),
    "runner.score_many": (_score_many, [["bleu1", "rouge_l"]]),
    "capeval score": (_cli_score, [["rouge_l"]]),
    "capeval bench": (_cli_bench, [["bleu1#0", "rouge_l#0"]]),  # one pass for both (each corpus of a corpus metric)
    "torchmetrics update, forward, compute": (_torchmetrics, [["rouge_l"], ["rouge_l"]]),
    "evaluate": (_evaluate, [["rouge_l"]]),
    "pycocoevalcap scorers": (_pycocoevalcap, [["rouge_l"], ["bleu1", "bleu2", "bleu3", "bleu4"], ["cider:4:6.0"]]),
    "lm-eval": (_lm_eval, [["rouge_l"]]),
    "lm-eval / lmms-eval documents": (_harness, [["rouge_l"]]),
    "MID.fit_reference": (_mid_fit, [["mid"]]),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_drives_the_sessions_loop(entry, watched, tmp_path, request):
    call, expected = ENTRY_POINTS[entry]
    args = {"tmp_path": tmp_path, "tiny_clip": None}
    if "tiny_clip" in call.__code__.co_varnames[:call.__code__.co_argcount]:
        args["tiny_clip"] = request.getfixturevalue("tiny_clip")
    call(*[args[name] for name in call.__code__.co_varnames[:call.__code__.co_argcount]])
    passes, maps = watched
    assert passes == expected
    assert maps and all(within for _, within in maps), [m for m in maps if not m[1]]


@pytest.mark.skipif(not has_java(), reason="COCOEvalCap tokenises with Java")
def test_cocoevalcaps_stock_scorers_are_one_pass(watched):
    """The drop-in's stock BLEU, METEOR, ROUGE-L and CIDEr: one pass for the four scorers."""
    from capeval_plugins.pycocoevalcap import COCOEvalCap

    class Coco:
        def __init__(self, anns):
            self.imgToAnns = anns

        def getImgIds(self):
            return list(self.imgToAnns)

    gts = Coco({i: [{"image_id": i, "caption": r} for r in refs] for i, refs in enumerate(REFERENCES)})
    res = Coco({i: [{"image_id": i, "caption": c}] for i, c in enumerate(CAPTIONS)})
    evaluator = COCOEvalCap(gts, res, spice=False)
    evaluator.evaluate()
    passes, maps = watched
    assert passes == [["bleu1", "bleu2", "bleu3", "bleu4", "cider:4:6.0", "meteor:corpus", "rouge_l"]]
    assert all(within for _, within in maps)


# ---------------------------------------------------------------------------------------------- the source

MAP_CALLS = {"map_batch", "map_part", "feed"}


def map_calls(path: Path) -> list[str]:
    """Calls in ``path`` that map a batch: ``map_batch(...)``, ``map_part(...)``, ``<x>.feed(...)``, or a metric's
    ``<x>.map(<batch>)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in MAP_CALLS or (name == "map" and isinstance(func, ast.Attribute) and len(node.args) == 1
                                 and not node.keywords and "batch" in ast.unparse(node.args[0])):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


# where mapping a batch is allowed: the session's loop and mapping, and the contract's own definition of a map
# (map_batch checks what a metric returns; CompositeMetric.map runs its components' maps)
ALLOWED = ("session/", "contract.py")


def test_no_module_outside_the_session_maps_a_batch():
    stray = [call for path in sorted(PACKAGE.rglob("*.py")) if not str(path.relative_to(PACKAGE)).startswith(ALLOWED)
             for call in map_calls(path)]
    assert not stray, "a batch mapped outside the session's loop:\n" + "\n".join(stray)


def test_the_walk_sees_a_second_loop(tmp_path):
    module = tmp_path / "adapters" / "mine.py"
    module.parent.mkdir()
    module.write_text("def update(self, parts):\n    for part in parts:\n        self.session.feed('m', part)\n"
                      "        self.metric.map(batch)\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        assert len(map_calls(module)) == 2
    finally:
        PACKAGE = saved
