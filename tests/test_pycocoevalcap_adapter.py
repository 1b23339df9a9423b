"""pycocoevalcap: scorer interface, image resolution, and a COCOEvalCap drop-in that keeps stock results."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import EXAMPLES, HANG_GUARD, has_java

import capeval_plugins
from capeval_plugins.caption_files import read_captions
from capeval_plugins.pycocoevalcap import COCOEvalCap, ClipScore, ImageResolver


def coco_files(tmp_path):
    """A COCO-format ground truth and result file from the shipped example (one candidate per image)."""
    records = read_captions(EXAMPLES / "captions.jsonl", EXAMPLES / "images")
    names = []
    for img in records.images:
        if img.split("/")[-1] not in names:
            names.append(img.split("/")[-1])
    first = {}
    for img, cap, refs in zip(records.images, records.captions, records.references):
        first.setdefault(img.split("/")[-1], (cap, refs))
    images = [{"id": i + 1, "file_name": n} for i, n in enumerate(names)]
    annotations, results = [], []
    for i, n in enumerate(names):
        cap, refs = first[n]
        annotations += [{"image_id": i + 1, "id": 10 * (i + 1) + j, "caption": r} for j, r in enumerate(refs)]
        results.append({"image_id": i + 1, "caption": cap})
    gt = tmp_path / "gt.json"
    gt.write_text(json.dumps({"images": images, "annotations": annotations, "info": {}, "licenses": [],
                              "type": "captions"}))
    res = tmp_path / "res.json"
    res.write_text(json.dumps(results))
    return gt, res, {i["id"]: i["file_name"] for i in images}, {r["image_id"]: r["caption"] for r in results}


def test_scorer_in_the_usual_loop_follows_gts_order(tiny_clip, tmp_path):
    gt, _, files, captions = coco_files(tmp_path)
    resolver = ImageResolver(EXAMPLES / "images", annotation_file=gt)
    ids = [3, 1, 4, 2]
    gts = {i: ["a reference"] for i in ids}
    res = {i: [captions[i]] for i in ids}
    scorers = [(ClipScore(resolver, model=tiny_clip), "CLIPScore")]
    for scorer, method in scorers:
        score, scores = scorer.compute_score(gts, res)
        assert method == scorer.method()
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(
        [EXAMPLES / "images" / files[i] for i in ids], [captions[i] for i in ids], [gts[i] for i in ids])
    assert list(scores) == pytest.approx(direct.scores.tolist(), abs=1e-6)
    assert score == pytest.approx(direct.score, abs=1e-6)


def test_resolver_refuses_escapes_and_unknown_ids(tmp_path):
    resolver = ImageResolver(tmp_path, mapping={1: "ok.png", 2: "../outside.png", 3: "/etc/passwd"})
    assert resolver(1) == (tmp_path / "ok.png").resolve()
    for bad in (2, 3):
        with pytest.raises(ValueError, match="outside the image root"):
            resolver(bad)
    with pytest.raises(KeyError):
        resolver(99)
    assert ImageResolver(tmp_path, pattern="{id:012d}.jpg")(7).name == "000000000007.jpg"


def test_image_scorer_needs_a_resolver(tiny_clip):
    with pytest.raises(ValueError, match="ImageResolver"):
        ClipScore(model=tiny_clip)


def test_scorer_rejects_mismatched_ids(tiny_clip, tmp_path):
    scorer = ClipScore(ImageResolver(tmp_path, mapping={1: "a.png"}), model=tiny_clip)
    with pytest.raises(ValueError, match="same image ids"):
        scorer.compute_score({1: ["x"]}, {2: ["y"]})
    with pytest.raises(ValueError, match="exactly one caption"):
        scorer.compute_score({1: ["x"]}, {1: ["y", "z"]})


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="pycocoevalcap's PTB tokenizer and METEOR need Java")
def test_cocoevalcap_dropin_keeps_stock_results_and_feeds_raw_text(tiny_clip, tmp_path, monkeypatch):
    from pycocotools.coco import COCO

    import pycocoevalcap.eval as stock_eval

    gt, res, files, captions = coco_files(tmp_path)
    coco = COCO(str(gt))
    coco_res = coco.loadRes(str(res))

    class NoSpice:  # SPICE downloads CoreNLP on first use, impossible offline: stub it in the stock run
        def method(self):
            return "SPICE"

        def compute_score(self, gts, res):
            return 0.0, [0.0] * len(gts)

    monkeypatch.setattr(stock_eval, "Spice", NoSpice)
    stock = stock_eval.COCOEvalCap(coco, coco_res)
    stock.evaluate()

    resolver = ImageResolver.from_coco(EXAMPLES / "images", coco)
    ours = COCOEvalCap(coco, coco_res, scorers=[ClipScore(resolver, model=tiny_clip)])  # spice=None: if present
    ours.evaluate()
    # stock's keys in stock's order (SPICE NaN where its jars are absent), ours after them
    assert list(ours.eval) == [*stock.eval, "CLIPScore"]
    assert all(list(ours.imgToEval[i]) == [*stock.imgToEval[i], "CLIPScore"] for i in stock.imgToEval)
    assert [list(e) for e in ours.evalImgs] == [[*e, "CLIPScore"] for e in stock.evalImgs]
    if "SPICE" in ours.unavailable:
        assert np.isnan(ours.eval["SPICE"]) and all(np.isnan(e["SPICE"]) for e in ours.evalImgs)
    for key in ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"):  # capeval's stock scorers: same numbers, types
        assert ours.eval[key] == pytest.approx(stock.eval[key], rel=1e-12, abs=0), key
        assert type(ours.eval[key]) is type(stock.eval[key]), key
        for img_id in stock.imgToEval:
            assert ours.imgToEval[img_id][key] == pytest.approx(stock.imgToEval[img_id][key], rel=1e-12, abs=0)
    # CLIPScore saw the raw captions (case and punctuation intact), not PTB tokens
    ids = list(coco.getImgIds())
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(
        [EXAMPLES / "images" / files[i] for i in ids], [captions[i] for i in ids],
        [[a["caption"] for a in coco.imgToAnns[i]] for i in ids])
    assert [ours.imgToEval[i]["CLIPScore"] for i in ids] == pytest.approx(direct.scores.tolist(), abs=1e-6)
    assert ours.eval["CLIPScore"] == pytest.approx(direct.score, abs=1e-6)
    assert {e["image_id"] for e in ours.evalImgs} == set(ids)


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="METEOR needs Java")
def test_stock_scorers_return_what_pycocoevalcaps_return(coco_meteor):
    """COCOEvalCap's stock scorers, capeval's implementation: pycocoevalcap's return shapes and types, its
    values to 1e-12 (bit for bit in practice), on tokenised text as COCOEvalCap hands it over."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    from capeval_plugins.adapters.pycocoevalcap import _stock_scorers

    words = "a dog man woman red ball runs on the grass two kids play".split()
    rng = random.Random(0)
    text = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))  # noqa: E731
    gts = {f"img{i}": [text() for _ in range(rng.randint(1, 5))] for i in range(30)}
    res = {i: [text()] for i in gts}
    res["img3"], gts["img4"] = gts["img3"][:1], list(gts["img5"])  # an exact match, a shared reference list
    theirs = [Bleu(4).compute_score(gts, res, verbose=0), coco_meteor.compute_score(gts, res),
              Rouge().compute_score(gts, res), Cider().compute_score(gts, res)]
    stock = _stock_scorers(spice=False)
    ours = [stock[0][0].compute_score(gts, res, verbose=0)] + [s.compute_score(gts, res) for s, _ in stock[1:]]
    assert [s.method() for s, _ in stock] == ["Bleu", "METEOR", "Rouge", "CIDEr"]
    for mine, peer in zip(ours, theirs):
        for a, b in zip(mine, peer):  # (corpus, per item)
            assert type(a) is type(b)
            if isinstance(b, list) and b and isinstance(b[0], list):  # BLEU's per-item: one list per order
                assert all(type(x) is type(y) and len(x) == len(y) for x, y in zip(a, b))
            assert np.asarray(a) == pytest.approx(np.asarray(b), rel=1e-12, abs=0)


def test_resolver_matches_an_id_however_its_number_was_read(tmp_path):
    """A results file whose ids went through a float column (7.0) or numpy finds image 7, by mapping and by
    pattern; an id given twice with different files is refused instead of the last one winning silently."""
    import numpy as np

    resolver = ImageResolver(tmp_path, mapping={7: "seven.png"})
    for image_id in (7, "7", 7.0, np.int64(7), np.float32(7.0)):
        assert resolver(image_id).name == "seven.png"
    pattern = ImageResolver(tmp_path, pattern="{id:012d}.jpg")
    assert pattern(7.0).name == pattern(np.int64(7)).name == "000000000007.jpg"
    with pytest.raises(ValueError, match="given twice"):
        ImageResolver(tmp_path, mapping={1: "a.png", "1": "b.png"})
    with pytest.raises(ValueError, match="boolean"):
        resolver(True)



# --- the usual loop: PTB-tokenise, then `for scorer, method in scorers` ------------------------------------------

LOOP_CAPTIONS = {1: "A red ball lies on the GREEN grass!", 2: "", 3: "A blue car, parked.", 4: "...",
                 5: "Two kids play in a park."}
LOOP_REFS = {1: ["A red ball on a lawn.", "A small red ball sitting on grass."], 2: ["A blue car on the road."],
             3: ["A toy car, blue, with black wheels.", "A car."], 4: ["A tree in a field."],
             5: ["Children playing outside.", "Kids in the park."]}


def _usual_loop(scorers, tokenizer=None):
    """The loop pycocoevalcap's users write (and lmms-eval's COCO tasks run): PTB tokens to every scorer."""
    if tokenizer is None:
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": c} for c in refs] for i, refs in LOOP_REFS.items()})
    res = tokenizer.tokenize({i: [{"caption": c}] for i, c in LOOP_CAPTIONS.items()})
    return {method: scorer.compute_score(gts, res) for scorer, method in scorers}, gts, res


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="PTB tokenisation and METEOR need Java")
def test_stock_names_give_stocks_numbers_types_and_methods_in_the_usual_loop(coco_meteor):
    """``from capeval_plugins.pycocoevalcap import Bleu, Meteor, Rouge, Cider``: stock's signatures, method()
    names, return types and numbers, captions that PTB empties ("", "...") included (stock scores them 0)."""
    import pycocoevalcap.eval as stock

    from capeval_plugins.pycocoevalcap import Bleu, Cider, Meteor, Rouge

    ours, gts, res = _usual_loop([(Bleu(4), "Bleu"), (Meteor(), "METEOR"), (Rouge(), "Rouge"), (Cider(), "CIDEr")])
    assert res[2] == [""] and res[4] == [""]  # emptied by PTB
    theirs = {"Bleu": stock.Bleu(4).compute_score(gts, res, verbose=0), "METEOR": coco_meteor.compute_score(gts, res),
              "Rouge": stock.Rouge().compute_score(gts, res), "CIDEr": stock.Cider().compute_score(gts, res)}
    assert [s().method() if s is not Bleu else s(4).method() for s in (Bleu, Meteor, Rouge, Cider)] == \
        ["Bleu", "METEOR", "Rouge", "CIDEr"]
    for method, (score, items) in ours.items():
        their_score, their_items = theirs[method]
        assert type(score) is type(their_score) and type(items) is type(their_items), method
        if method == "Bleu":
            assert all(type(a) is type(b) for a, b in zip(items, their_items))
        assert np.asarray(score) == pytest.approx(np.asarray(their_score), rel=1e-9, abs=1e-12), method
        assert np.asarray(items) == pytest.approx(np.asarray(their_items), rel=1e-9, abs=1e-12), method
    assert np.asarray(ours["CIDEr"][1])[[1, 3]].tolist() == [0.0, 0.0]


LOOP_NAMES = {1: "red_ball.png", 2: "blue_car.png", 3: "blue_car.png", 4: "green_tree.png", 5: "yellow_sun.png"}


def _direct_clipscore(tiny_clip, captions):
    ids = list(LOOP_CAPTIONS)
    return capeval_plugins.load("clipscore", model=tiny_clip)([EXAMPLES / "images" / LOOP_NAMES[i] for i in ids],
                                                              [captions[i] for i in ids])


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="PTB tokenisation needs Java")
def test_an_image_text_scorer_in_the_usual_loop_scores_the_captions_as_written(tiny_clip):
    """CLIPScore in the usual loop with capeval's PTBTokenizer (stock's, remembering the captions) gets the
    captions before PTB (case and punctuation intact), not the tokens the stock scorers get; a token dict changed
    after tokenisation is refused naming the fix."""
    from capeval_plugins.pycocoevalcap import ClipScore, ImageResolver, PTBTokenizer

    scorer = ClipScore(ImageResolver(EXAMPLES / "images", mapping=LOOP_NAMES), model=tiny_clip)
    ours, gts, res = _usual_loop([(scorer, "CLIPScore")], PTBTokenizer())
    direct = _direct_clipscore(tiny_clip, LOOP_CAPTIONS)
    score, items = ours["CLIPScore"]
    assert type(items) is list and items == pytest.approx(direct.scores.tolist(), abs=1e-6)
    assert score == pytest.approx(direct.score, abs=1e-6)
    on_tokens = _direct_clipscore(tiny_clip, {i: res[i][0] for i in LOOP_CAPTIONS})
    assert abs(on_tokens.scores[0] - direct.scores[0]) > 1e-4  # the tokens would have given another number
    res[1] = ["something else"]
    with pytest.raises(ValueError, match="pass CLIPScore the captions before PTBTokenizer"):
        scorer.compute_score(gts, res)


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="PTB tokenisation needs Java")
def test_stock_tokens_are_refused_in_one_line_and_coco_dicts_are_read_as_written(tiny_clip):
    """Stock's PTBTokenizer (or a user's subclass of it) hands over tokens only: CLIPScore refuses them in one
    line naming the fixes rather than scoring them; given the dicts stock's tokenizer takes, it scores the
    captions as written; told the plain captions are written so, it scores them as given."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer as Stock

    from capeval_plugins.pycocoevalcap import ClipScore, ImageResolver, PTBTokenizer

    class UsersTokenizer(Stock):  # e.g. to log: stock's tokens, nothing remembered
        def tokenize(self, captions_for_image):
            return super().tokenize(captions_for_image)

    class UsersCapevalTokenizer(PTBTokenizer):
        pass

    resolver = ImageResolver(EXAMPLES / "images", mapping=LOOP_NAMES)
    scorer = ClipScore(resolver, model=tiny_clip)
    direct = _direct_clipscore(tiny_clip, LOOP_CAPTIONS)
    for tokenizer in (Stock(), UsersTokenizer()):
        with pytest.raises(ValueError, match=r"looks PTB-tokenised.*capeval_plugins.pycocoevalcap.PTBTokenizer") as err:
            _usual_loop([(scorer, "CLIPScore")], tokenizer)
        assert "\n" not in str(err.value)
    ours, gts, res = _usual_loop([(scorer, "CLIPScore")], UsersCapevalTokenizer())
    assert ours["CLIPScore"][1] == pytest.approx(direct.scores.tolist(), abs=1e-6)
    as_coco = ({i: [{"caption": c} for c in refs] for i, refs in LOOP_REFS.items()},
               {i: [{"caption": c}] for i, c in LOOP_CAPTIONS.items()})
    assert scorer.compute_score(*as_coco)[1] == pytest.approx(direct.scores.tolist(), abs=1e-6)
    plain_tokens = {i: list(v) for i, v in res.items()}
    assumed = ClipScore(resolver, model=tiny_clip, assume_written=True).compute_score(dict(gts), plain_tokens)[1]
    assert assumed == pytest.approx(_direct_clipscore(tiny_clip, {i: res[i][0] for i in res}).scores.tolist(), abs=1e-6)


def test_what_looks_ptb_tokenised():
    """Only a corpus every caption of which could be PTB output is refused: one capital letter or sentence mark
    anywhere means captions as written."""
    from capeval_plugins.adapters.pycocoevalcap import looks_ptb_tokenized

    assert all(map(looks_ptb_tokenized, ["a red ball lies on the green grass", "", "a dog 's bone", "3.5 m"]))
    assert not any(map(looks_ptb_tokenized, ["A red ball.", "a red ball.", "a dog, running", "a  dog", " a dog",
                                             "is it a dog ?", "wow!", None]))


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="PTB tokenisation and METEOR need Java")
@pytest.mark.parametrize("order", ["stock-first", "capeval-first"])
def test_the_usual_loop_is_the_same_in_both_import_orders(tiny_clip, tmp_path, order):
    """A fresh interpreter each: stock's PTBTokenizer imported and used before or after
    capeval_plugins.pycocoevalcap. Either way stock's tokens are refused in one line, the captions as COCO holds
    them (or through capeval's tokenizer, which gives stock's tokens) score as written, and importing the adapter
    changes no attribute of pycocoevalcap's classes nor the numbers of stock's own example."""
    import subprocess
    import sys

    from conftest import ROOT

    data = tmp_path / "captions.json"
    data.write_text(json.dumps({"gts": LOOP_REFS, "res": {i: [c] for i, c in LOOP_CAPTIONS.items()},
                                "names": LOOP_NAMES}))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "pycocoevalcap_import_order.py"), order,
                           tiny_clip, str(EXAMPLES / "images"), str(data)], capture_output=True, text=True, timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    expected = _direct_clipscore(tiny_clip, LOOP_CAPTIONS).scores.tolist()
    assert out["stock_tokens_type"] == "dict"
    assert "looks PTB-tokenised" in out["on_stock_tokens"] and "\n" not in out["on_stock_tokens"]
    for way in ("as_coco_holds_them", "plain_as_written", "capeval_tokenizer"):
        assert out[way] == pytest.approx(expected, abs=1e-6), way
    assert out["capeval_tokens_equal_stock"]
    assert out["on_stock_tokens_assumed_written"] != pytest.approx(expected, abs=1e-4)
    if order == "stock-first":
        assert out["stock_classes_unchanged"]
        assert out["stock_example_after"] == out["stock_example_before"]


# Characters Java reads as line breaks: pycocoevalcap writes one caption per line, so each shifts every later row.
LINE_BREAKS = ["\r", "\u2028", "\x0b", "\x0c", "\u2029"]


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="PTB tokenisation needs Java")
def test_cocoevalcap_keeps_rows_aligned_where_stock_shifts_them(tmp_path, monkeypatch):
    """A caption holding \\r, U+2028, \\x0b, \\x0c or U+2029 splits into two lines in the stock PTB tokenizer, so
    stock's COCOEvalCap scores every later image against another caption; ours reads them as spaces and gives
    each image the score stock gives when the captions hold spaces instead."""
    from pycocotools.coco import COCO

    import pycocoevalcap.eval as stock_eval

    class NoMeteorNoSpice:
        def __init__(self, name):
            self.name = name

        def method(self):
            return self.name

        def compute_score(self, gts, res):
            return 0.0, [0.0] * len(gts)

    monkeypatch.setattr(stock_eval, "Spice", lambda: NoMeteorNoSpice("SPICE"))
    monkeypatch.setattr(stock_eval, "Meteor", lambda: NoMeteorNoSpice("METEOR"))
    words = ["a red ball on green grass", "a blue car", "a tall tree", "the yellow sun", "two dogs", "a cat"]
    captions = [f"{w.split(' ', 1)[0]}{b}{w.split(' ', 1)[1]}" for w, b in zip(words, LINE_BREAKS + [" "])]

    def evaluate(cls, texts, **kwargs):
        gt = {"images": [{"id": i + 1} for i in range(len(texts))], "info": {}, "licenses": [], "type": "captions",
              "annotations": [{"image_id": i + 1, "id": i + 1, "caption": w} for i, w in enumerate(words)]}
        (tmp_path / "gt.json").write_text(json.dumps(gt))
        (tmp_path / "res.json").write_text(json.dumps([{"image_id": i + 1, "caption": c} for i, c in enumerate(texts)]))
        coco = COCO(str(tmp_path / "gt.json"))
        evaluator = cls(coco, coco.loadRes(str(tmp_path / "res.json")), **kwargs)
        evaluator.evaluate()
        return evaluator

    ours = evaluate(COCOEvalCap, captions, spice=False, stock=False, metrics=["cider", "bleu1"])
    spaced = evaluate(stock_eval.COCOEvalCap, [c.translate({ord(b): " " for b in LINE_BREAKS}) for c in captions])
    shifted = evaluate(stock_eval.COCOEvalCap, captions)
    for key in ("CIDEr", "Bleu_1"):
        assert ours.eval[key] == pytest.approx(spaced.eval[key], rel=1e-9)
        for i in range(1, len(words) + 1):
            assert ours.imgToEval[i][key] == pytest.approx(spaced.imgToEval[i][key], rel=1e-9, abs=1e-12)
    assert shifted.imgToEval[2]["Bleu_1"] != pytest.approx(spaced.imgToEval[2]["Bleu_1"])  # stock misaligned


# --- stock's other methods: Rouge().calc_score, Meteor()._stat / _score / __del__ ----------------------------------

ROUGE_CASES = [(["a dog runs on the grass"], ["a dog is running on grass", "the dog runs"]),
               ([""], ["a cat"]), (["a  dog"], ["a dog", ""]), (["naïve café 中文 ."], ["café naïve", "中文"]),
               (["the the the"], ["the"]), (["x"], ["y z"])]


# Captions whose PTB tokens PTB changes again ("'t was" -> "t was", "y' all" -> "y all") and references PTB empties
TRICKY_REFS = {1: ["Y'all come to the party", "people come to a party", "..."], 2: ["'Twas a cold night.", "\U0001f436"],
               3: ["A dog runs!", "a dog running"]}
TRICKY_CAPTIONS = {1: "Y'all come to the party", 2: "'Twas a cold dark night", 3: "A dog runs."}


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="PTB tokenisation and METEOR need Java")
def test_stock_tokens_in_plain_dicts_are_scored_as_given_as_stock_scores_them(coco_meteor):
    """The drop-in with stock's own tokenizer: plain ``{id: [text]}`` dicts are scored as pycocoevalcap's
    scorers score them, as given. PTB is not the identity on its own tokens, and it empties "..." and emoji:
    tokenising again gave BLEU-4 1.0 for stock's 0.72, and refused the blank reference stock scores."""
    from pycocoevalcap.bleu.bleu import Bleu as StockBleu
    from pycocoevalcap.cider.cider import Cider as StockCider
    from pycocoevalcap.rouge.rouge import Rouge as StockRouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer as StockPTB

    from capeval_plugins.pycocoevalcap import Bleu, Cider, Meteor, Rouge

    tokenizer = StockPTB()
    gts = tokenizer.tokenize({i: [{"caption": c} for c in refs] for i, refs in TRICKY_REFS.items()})
    res = tokenizer.tokenize({i: [{"caption": c}] for i, c in TRICKY_CAPTIONS.items()})
    assert "" in gts[1] and gts[2][1] == "" and "'t" in gts[2][0]  # the cases at stake are in the corpus
    theirs = {"Bleu": StockBleu(4).compute_score(gts, res, verbose=0), "CIDEr": StockCider().compute_score(gts, res),
              "Rouge": StockRouge().compute_score(gts, res), "METEOR": coco_meteor.compute_score(gts, res)}
    ours = {"Bleu": Bleu(4).compute_score(gts, res), "CIDEr": Cider().compute_score(gts, res),
            "Rouge": Rouge().compute_score(gts, res), "METEOR": Meteor().compute_score(gts, res)}
    for method, (score, items) in theirs.items():
        assert np.asarray(ours[method][0]) == pytest.approx(np.asarray(score), rel=1e-12, abs=0), method
        assert np.asarray(ours[method][1]) == pytest.approx(np.asarray(items), rel=1e-12, abs=0), method
    # captions known as written (COCO's dicts, or assume_written=True) are tokenised once, by the metric
    coco = {i: [{"caption": c} for c in refs] for i, refs in TRICKY_REFS.items()}
    written = Cider().compute_score(coco, {i: [{"caption": c}] for i, c in TRICKY_CAPTIONS.items()})
    assert written[0] == pytest.approx(theirs["CIDEr"][0], rel=1e-12, abs=0)
    plain = {i: list(refs) for i, refs in TRICKY_REFS.items()}, {i: [c] for i, c in TRICKY_CAPTIONS.items()}
    assert Cider(assume_written=True).compute_score(*plain)[0] == pytest.approx(written[0], rel=1e-12, abs=0)
    assert Cider().compute_score(*plain)[0] == pytest.approx(StockCider().compute_score(*plain)[0], rel=1e-12, abs=0)


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="PTB tokenisation and METEOR need Java")
def test_cocoevalcap_scores_a_reference_ptb_empties_as_stock_does(tmp_path, coco_meteor):
    """COCOEvalCap hands its scorers PTB tokens, among them the blank string PTB makes of "..." or of emoji:
    stock scores it; ours refused the sample ("reference 0 is empty")."""
    coco, coco_res = _tricky_coco(tmp_path)
    ours = COCOEvalCap(coco, coco_res, spice=False)
    ours.evaluate()
    for key, value in _stock_evaluation(coco, coco_res, coco_meteor).items():
        assert ours.eval[key] == pytest.approx(value, rel=1e-12, abs=0), key


def _tricky_coco(tmp_path):
    """(ground truth, results) as pycocotools loads them: TRICKY_REFS and TRICKY_CAPTIONS written as COCO files."""
    from pycocotools.coco import COCO

    images = [{"id": i, "file_name": f"{i}.jpg"} for i in TRICKY_REFS]
    annotations = [{"image_id": i, "id": 10 * i + j, "caption": c} for i, refs in TRICKY_REFS.items()
                   for j, c in enumerate(refs)]
    gt, res = tmp_path / "gt.json", tmp_path / "res.json"
    gt.write_text(json.dumps({"images": images, "annotations": annotations, "info": {}, "licenses": [],
                              "type": "captions"}))
    res.write_text(json.dumps([{"image_id": i, "caption": c} for i, c in TRICKY_CAPTIONS.items()]))
    coco = COCO(str(gt))
    coco_res = coco.loadRes(str(res))
    return coco, coco_res


def _stock_evaluation(coco, coco_res, meteor) -> dict:
    """Stock COCOEvalCap's corpus scores but SPICE's (its jars need a download): its own tokenizer and scorers,
    in its order."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    ids = coco_res.getImgIds()
    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: coco.imgToAnns[i] for i in ids})
    res = tokenizer.tokenize({i: coco_res.imgToAnns[i] for i in ids})
    out = {}
    for scorer, method in ((Bleu(4), ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4"]), (meteor, "METEOR"),
                           (Rouge(), "ROUGE_L"), (Cider(), "CIDEr")):
        score, _ = scorer.compute_score(gts, res)
        out.update(zip(method, score) if isinstance(method, list) else [(method, score)])
    return out


def test_rouge_calc_score_is_stocks_on_the_text_as_given():
    """``Rouge().calc_score`` (per-sample ROUGE-L, as RL rewards call it) is stock's, on random token lists and
    on the cases its single-space split makes odd (empty strings, double spaces); bad arguments are refused in
    one line where stock asserts."""
    from pycocoevalcap.rouge.rouge import Rouge as StockRouge

    from capeval_plugins.pycocoevalcap import Rouge

    rng = random.Random(1)
    words = "a dog man red ball runs on the grass".split()
    text = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))  # noqa: E731
    cases = ROUGE_CASES + [([text()], [text() for _ in range(rng.randint(1, 5))]) for _ in range(200)]
    ours, stock = Rouge(), StockRouge()
    for candidate, refs in cases:
        mine = ours.calc_score(candidate, refs)
        assert type(mine) is float
        assert mine == pytest.approx(stock.calc_score(candidate, refs), rel=1e-12, abs=0), (candidate, refs)
    for candidate, refs in ((["a", "b"], ["a"]), ("a dog", ["a"]), (["a"], []), (["a"], "a dog"), ([1], ["a"])):
        with pytest.raises(ValueError, match="Rouge.calc_score"):
            ours.calc_score(candidate, refs)


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="METEOR needs Java")
def test_meteor_stat_score_and_del_are_stocks(coco_meteor):
    """``Meteor()._stat`` gives the jar's statistics line stock's gives (its JVM loads the full paraphrase
    table, ours the corpus's); ``_score`` (broken in stock under Python 3) gives the score stock's
    ``compute_score`` gives one segment; ``__del__()`` may be called as stock's users do, and the scorer and the
    process's JVM go on working."""
    from capeval_plugins.pycocoevalcap import Meteor

    segments = [("a dog runs on the grass", ["a dog is running on grass", "the dog runs"]),
                ("two kids play", ["children playing outside", "kids in the park"]), ("x", ["a tree in a field"])]
    ours = Meteor()
    for hypothesis, refs in segments:
        assert ours._stat(hypothesis, refs) == coco_meteor._stat(hypothesis, refs)
        stock_score, _ = coco_meteor.compute_score({0: refs}, {0: [hypothesis]})
        assert ours._score(hypothesis, refs) == pytest.approx(stock_score, rel=1e-12, abs=0)
    ours.__del__()
    assert ours._stat(*segments[0]) == coco_meteor._stat(*segments[0])
    for bad in ((1, ["a"]), ("a", []), ("a", "a dog"), ("a", [None])):
        with pytest.raises(ValueError, match="Meteor._stat"):
            ours._stat(*bad)
    with pytest.raises(ValueError, match="implementation='nltk'"):
        Meteor(implementation="nltk")._stat("a", ["a"])


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="PTB tokenisation needs Java")
def test_the_usual_loop_tokenises_once_unless_stock_shifted_the_captions(monkeypatch):
    """With capeval's PTBTokenizer the classic scorers, which tokenise the captions as written again, reuse the
    tokens stock's tokenizer just made (no second Java tokenizer); where a caption holds a line break stock
    splits on, stock's tokens are shifted, nothing is reused, and each image keeps its own caption's score."""
    import pycocoevalcap.eval as stock

    from capeval_plugins.metrics import coco
    from capeval_plugins.pycocoevalcap import Bleu, Cider, PTBTokenizer, Rouge
    from capeval_plugins.resources import java

    calls = []
    ptb = java.ptb_files
    monkeypatch.setattr(java, "ptb_files", lambda texts, jar: calls.append(len(texts)) or ptb(texts, jar))
    coco.forget_prepared()
    ours, gts, res = _usual_loop([(Bleu(4), "Bleu"), (Rouge(), "Rouge"), (Cider(), "CIDEr")], PTBTokenizer())
    assert not any(calls)  # stock's own tokenizer ran twice (gts, res) in its own way; ours never
    gts, res = dict(gts), dict(res)
    theirs = {"Bleu": stock.Bleu(4).compute_score(gts, res, verbose=0), "Rouge": stock.Rouge().compute_score(gts, res),
              "CIDEr": stock.Cider().compute_score(gts, res)}
    for method, (score, items) in ours.items():
        assert np.asarray(score) == pytest.approx(np.asarray(theirs[method][0]), rel=1e-12, abs=0), method
        assert np.asarray(items) == pytest.approx(np.asarray(theirs[method][1]), rel=1e-12, abs=0), method

    coco.forget_prepared()
    broken = {i: [{"caption": c.replace(" ", "\r", 1) if i == 1 else c}] for i, c in LOOP_CAPTIONS.items()}
    tokens = PTBTokenizer().tokenize(broken)
    assert tokens[3] != coco.ptb_texts([LOOP_CAPTIONS[3]])  # stock gave image 3 another line's tokens
    calls.clear()
    rouge = Rouge().compute_score({i: [{"caption": r} for r in refs] for i, refs in LOOP_REFS.items()}, broken)[1]
    spaced = {i: [{"caption": c}] for i, c in LOOP_CAPTIONS.items()}
    assert any(calls) and rouge.tolist() == pytest.approx(
        Rouge().compute_score({i: [{"caption": r} for r in refs] for i, refs in LOOP_REFS.items()}, spaced)[1].tolist())


def test_cider_takes_stocks_signature():
    """``Cider(test=None, refs=None, n=4, sigma=6.0)``, positionally or by name, gives stock's CIDEr-D (text as
    given, ``tokenize=False``); a ``test`` or ``refs`` other than None, which stock would silently ignore, is
    refused in one line."""
    from pycocoevalcap.cider.cider import Cider as StockCider

    from capeval_plugins.pycocoevalcap import Cider

    rng = random.Random(2)
    words = "a dog man red ball runs on the grass two kids play".split()
    text = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))  # noqa: E731
    gts = {i: [text() for _ in range(rng.randint(1, 5))] for i in range(20)}
    res = {i: [text()] for i in gts}
    stock = StockCider().compute_score(gts, res)
    for scorer in (Cider(None, None, 4, 6.0, tokenize=False), Cider(test=None, refs=None, tokenize=False),
                   Cider(n=4, sigma=6.0, tokenize=False), Cider(tokenize=False),
                   Cider(metric=capeval_plugins.load("cider", tokenize=False)), Cider(resolver=None, tokenize=False)):
        score, items = scorer.compute_score(gts, res)
        assert score == pytest.approx(stock[0], rel=1e-12) and items == pytest.approx(stock[1], rel=1e-12, abs=1e-15)
    assert Cider(None, None, 3, 2.0, tokenize=False).metric.config.n == 3
    with pytest.raises(ValueError, match="test and refs are not used"):
        Cider(test=gts)


@pytest.mark.skipif(not has_java(), reason="PTB tokenisation needs Java")
def test_cocoevalcap_given_a_bare_bleu_scorer_fills_each_order(tmp_path):
    """``scorers=[Bleu(4)]`` (no method names): the four orders went under one key "Bleu", each image's entry
    held one order's scores for several images, and the summary then raised a TypeError."""
    from capeval_plugins.pycocoevalcap import Bleu

    coco, coco_res = _tricky_coco(tmp_path)
    named = COCOEvalCap(coco, coco_res, scorers=[(Bleu(4, tokenize=False), [f"Bleu_{k}" for k in range(1, 5)])],
                        stock=False)
    named.evaluate()
    bare = COCOEvalCap(coco, coco_res, scorers=[Bleu(4, tokenize=False)], stock=False)
    bare.evaluate()
    assert bare.eval == named.eval and set(bare.eval) == {f"Bleu_{k}" for k in range(1, 5)}
    assert bare.imgToEval == named.imgToEval
