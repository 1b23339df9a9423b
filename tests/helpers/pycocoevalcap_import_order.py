"""Run by tests/test_pycocoevalcap_adapter.py in a fresh interpreter: the usual scorer loop with stock's
PTBTokenizer imported before or after ``capeval_plugins.pycocoevalcap`` (what a fresh process is the test of).
Prints one JSON line: what ClipScore made of each way of handing the captions over, and whether importing the
adapter changed any attribute of pycocoevalcap's classes or stock COCOEvalCap's numbers.

    python pycocoevalcap_import_order.py ORDER CLIP_FOLDER IMAGES_FOLDER CAPTIONS_JSON
"""
from __future__ import annotations

import contextlib
import io
import json
import sys


def stock_classes() -> dict:
    """Every attribute of every class pycocoevalcap's evaluation module names (the stock loop's whole surface)."""
    import pycocoevalcap.eval as stock

    classes = (stock.COCOEvalCap, stock.PTBTokenizer, stock.Bleu, stock.Meteor, stock.Rouge, stock.Cider, stock.Spice)
    return {cls.__name__: dict(vars(cls)) for cls in classes}


def stock_example(gts: dict, res: dict) -> dict:
    """pycocoevalcap's example (``COCOEvalCap(coco, coco_result).evaluate()``) on these captions, SPICE left out
    (its CoreNLP models are a download) the way a user without them would: a scorer list without it."""
    import pycocoevalcap.eval as stock

    class Coco:  # what COCOEvalCap reads of a pycocotools COCO object
        def __init__(self, captions):
            self.imgToAnns = {i: [{"image_id": i, "caption": c} for c in caps] for i, caps in captions.items()}

        def getImgIds(self):
            return list(self.imgToAnns)

    class NoSpice(stock.COCOEvalCap):
        def evaluate(self):
            spice, stock.Spice = stock.Spice, lambda: type("Off", (), {"method": lambda s: "SPICE",
                                                                       "compute_score": lambda s, g, r: (0.0, [0.0] * len(g))})()
            try:
                super().evaluate()
            finally:
                stock.Spice = spice

    evaluator = NoSpice(Coco(gts), Coco(res))
    with contextlib.redirect_stdout(io.StringIO()):
        evaluator.evaluate()
    return {k: float(v) for k, v in evaluator.eval.items()}


def main() -> None:
    order, clip, images, captions_file = sys.argv[1:]
    data = json.loads(open(captions_file, encoding="utf-8").read())
    gts = {int(k): v for k, v in data["gts"].items()}
    res = {int(k): v for k, v in data["res"].items()}
    names = {int(k): v for k, v in data["names"].items()}
    as_coco = ({i: [{"caption": c} for c in caps] for i, caps in gts.items()},
               {i: [{"caption": c} for c in caps] for i, caps in res.items()})
    out: dict = {"order": order}
    if order == "stock-first":
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        tokens = PTBTokenizer().tokenize(as_coco[0]), PTBTokenizer().tokenize(as_coco[1])
        out["stock_example_before"] = stock_example(gts, res)
        before = stock_classes()
        import capeval_plugins.pycocoevalcap as ours
    else:
        import capeval_plugins.pycocoevalcap as ours
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        before = None
        tokens = PTBTokenizer().tokenize(as_coco[0]), PTBTokenizer().tokenize(as_coco[1])
    scorer = ours.ClipScore(ours.ImageResolver(images, mapping=names), model=clip)
    out["stock_tokens_type"] = type(tokens[1]).__name__
    try:
        scorer.compute_score(*tokens)
        out["on_stock_tokens"] = "scored"
    except ValueError as error:
        out["on_stock_tokens"] = str(error)
    out["as_coco_holds_them"] = scorer.compute_score(*as_coco)[1]
    out["plain_as_written"] = scorer.compute_score(gts, res)[1]
    ptb = ours.PTBTokenizer()
    out["capeval_tokenizer"] = scorer.compute_score(ptb.tokenize(as_coco[0]), ptb.tokenize(as_coco[1]))[1]
    out["capeval_tokens_equal_stock"] = [dict(ptb.tokenize(c)) for c in as_coco] == [dict(t) for t in tokens]
    out["on_stock_tokens_assumed_written"] = ours.ClipScore(ours.ImageResolver(images, mapping=names), model=clip,
                                                            assume_written=True).compute_score(*tokens)[1]
    if before is not None:
        after = stock_classes()
        out["stock_classes_unchanged"] = after == before
        out["stock_example_after"] = stock_example(gts, res)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
