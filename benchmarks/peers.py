"""Side by side with the peer packages the metrics reimplement, on realistic inputs: agreement and speed.

    python benchmarks/peers.py                     # every part; CLIPScore on a random full-size ViT-B/32 CLIP
    python benchmarks/peers.py --quick             # a smoke run: tiny CLIP, few rows (a minute or two)
    python benchmarks/peers.py --parts coco mid --rounds 5

Inputs: Flickr8k-Expert's distinct (image, caption) pairs with their image's 5 references (flickr8k.json under
$CAPEVAL_BENCHDATA, default ../shared/benchdata), the first --*-images images of the file; each image is a
distinct crop of one of seven real photos (scikit-image's astronaut, chelsea, coffee, rocket, motorcycle_left,
camera; matplotlib's grace_hopper), cycled. Parts (each skipped with a message when its data or peer is
missing):

  clipscore  capeval `clipscore` with w=100, no prompt and the processor (torchmetrics' definition, 100 cos) against
             torchmetrics' CLIPScore (updates of --batch-size rows), same model and image tensors.
  coco       `capeval score -m bleu4 -m meteor -m rouge_l -m cider` against pycocoevalcap's own loop as
             COCOEvalCap.evaluate runs it (PTB-tokenise references, then candidates, then each scorer), each side
             a whole process of its own (Python, its JVMs) on a captions file of every Flickr8k-Expert row
             (16,992: one per expert rating; --coco-distinct: the 5,664 distinct pairs); every per-item and
             corpus value compared.
  coco-math  BLEU-1..4, ROUGE-L and CIDEr-D alone, in this process, on the same PTB tokens: pycocoevalcap's
             scorers against capeval's core/coco_text.py.
  mid        capeval `mid` end to end against the official MID computation (naver-ai/mid.metric, not on PyPI:
             re-implemented here) on features from plain transformers, one image encoded per row as the
             official evaluation loop does. Uses --mid-model (default: the tiny CLIP): a fit at ViT-B/32's size
             needs more than 512 distinct images, over 2,900 rows, too slow on a CPU.
  mid-math   the MID computation alone at the CLIP model's feature size, on every Flickr8k-Expert pair
             (28,320 (image, reference) pairs fitted, 5,664 scored) with synthetic unit features shaped like
             the corpus (one per image, one per text): the metric's per-batch sums, merge and finalize against
             the official computation.

Timing: --rounds interleaved rounds (the order alternates), one process, torch threads fixed (--threads).
CPU time is this process's plus its Java children's (the PTB tokenizer, METEOR's JVM), read from the kernel,
so load from other jobs on a shared machine disturbs it less than wall time; for coco, the CPU time of each
side's process and every descendant it waited for (wait4). Printed per side: median CPU
time with its min-max over rounds, median wall time, and the ratio peer / capeval of the medians (> 1: capeval
is faster) with its min-max over rounds; then the largest |difference| of the scores, which must be small.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", ROOT.parent / "shared" / "benchdata"))
FLICKR = BENCHDATA / "flickr8k_expert" / "flickr8k.json"
PARTS = ("clipscore", "coco", "coco-math", "mid", "mid-math")


class Skip(Exception):
    """A part cannot run here (data or peer missing); the message says why."""


# ---------------------------------------------------------------------------------------------- timing

def live_children_cpu() -> float:
    """CPU seconds of this process's running children (METEOR's JVM lives across calls), from /proc."""
    me, tick, total = os.getpid(), os.sysconf("SC_CLK_TCK"), 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == me:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def cpu_seconds() -> float:
    """CPU time of this process, its finished children (waited for: the PTB tokenizer's JVM) and its live ones."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + live_children_cpu()


def interleaved(sides: dict[str, Callable[[], Any]], rounds: int) -> tuple[dict[str, list], dict[str, Any]]:
    """(wall, cpu) seconds of each side per round, the order alternating between rounds so a change of load
    on the machine hits both alike; and each side's last result."""
    times: dict[str, list] = {name: [] for name in sides}
    results: dict[str, Any] = {}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            wall, cpu = time.perf_counter(), cpu_seconds()
            results[name] = sides[name]()
            times[name].append((time.perf_counter() - wall, cpu_seconds() - cpu))
    return times, results


def report(times: dict[str, list], peer: str, ours: str) -> None:
    for name in (peer, ours):
        cpu = [c for _, c in times[name]]
        wall = [w for w, _ in times[name]]
        print(f"  {name:30s} cpu {statistics.median(cpu):8.2f} s ({min(cpu):.2f}-{max(cpu):.2f})"
              f"   wall {statistics.median(wall):8.2f} s")
    ratio = lambda k: statistics.median(t[k] for t in times[peer]) / statistics.median(t[k] for t in times[ours])  # noqa: E731
    per_round = [p[1] / o[1] for p, o in zip(times[peer], times[ours])]
    print(f"  ratio {peer} / {ours}: cpu {ratio(1):.2f} ({min(per_round):.2f}-{max(per_round):.2f} by round), "
          f"wall {ratio(0):.2f}")


# ---------------------------------------------------------------------------------------------- inputs

def flickr_pairs(images: int | None):
    from capeval_plugins.testing.realistic import flickr8k_expert_pairs

    if not FLICKR.is_file():
        raise Skip(f"no Flickr8k-Expert at {FLICKR} (set CAPEVAL_BENCHDATA)")
    return flickr8k_expert_pairs(FLICKR, images)


PHOTO_SIDE = 500  # Flickr8k's photos: 500 px on the longer side, scored as they are on both sides


def row_images(pairs, long_side: int, as_tensor: bool = False) -> list:
    """One image per row, the same object for the rows of one image (as a caption file naming one path)."""
    try:
        from capeval_plugins.testing.realistic import photo_crops

        crops = photo_crops(pairs.n_images, long_side=long_side)
    except ImportError as err:
        raise Skip(f"the photos need scikit-image and matplotlib ({err})") from None
    if as_tensor:
        crops = [torch.from_numpy(np.array(c)).permute(2, 0, 1).contiguous() for c in crops]
    return [crops[k] for k in pairs.image]


def chunks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


# ---------------------------------------------------------------------------------------------- clipscore

def pooled(output):
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def torchmetrics_clip(clip, processor):
    """The loader torchmetrics' CLIPScore calls, with transformers 5's outputs unwrapped."""
    from capeval_plugins.testing.peers import TensorFeatures

    return TensorFeatures(clip), processor


def recorded_torchmetrics_scores() -> list:
    """torchmetrics' per-sample 100 cos of every update, recorded as its CLIPScore computes them (it keeps only
    their sum): its update calls the module-level function, wrapped here to keep a copy of what it returns."""
    import torchmetrics.multimodal.clip_score as module

    seen: list = []
    original = module._clip_score_update

    def record(*args, **kwargs):
        score, n = original(*args, **kwargs)
        seen.append(score.detach().cpu().double())
        return score, n

    module._clip_score_update = record
    return seen


def clipscore_part(args, models: "Models") -> None:
    try:
        from torchmetrics.multimodal.clip_score import CLIPScore as TMCLIPScore
        from transformers import CLIPModel, CLIPProcessor
    except ImportError as err:
        raise Skip(f"torchmetrics' CLIPScore is not available ({err})") from None
    import capeval_plugins

    pairs = flickr_pairs(args.clip_images)
    model = models.main()
    clip, processor = CLIPModel.from_pretrained(model).eval(), CLIPProcessor.from_pretrained(model)
    images, captions = row_images(pairs, PHOTO_SIDE, as_tensor=True), pairs.candidates
    theirs = TMCLIPScore(model_name_or_path=lambda: torchmetrics_clip(clip, processor))
    seen = recorded_torchmetrics_scores()
    ours = capeval_plugins.load("clipscore", model=model, w=100.0, prefix="", preprocessing="transformers",
                                batch_size=args.batch_size)

    def peer():
        seen.clear()
        theirs.reset()
        for part in chunks(len(captions), args.batch_size):
            theirs.update(images[part], captions[part])
        return float(theirs.compute()), torch.cat(seen)

    def capeval():
        result = ours(images, captions)
        return 100 * result.extras["cosine"].double()

    with torch.inference_mode(), warnings_off():
        ours(images[:2], captions[:2])  # loads the shared model outside the timing
        theirs.update(images[:2], captions[:2])
        print(f"[clipscore] {len(captions)} pairs of {pairs.n_images} images ({PHOTO_SIDE} px), model {model}, "
              f"torch threads {torch.get_num_threads()}, batch {args.batch_size}, {args.rounds} rounds")
        times, results = interleaved({"torchmetrics CLIPScore": peer, "capeval clipscore": capeval}, args.rounds)
    report(times, "torchmetrics CLIPScore", "capeval clipscore")
    (corpus, per_sample), cos100 = results["torchmetrics CLIPScore"], results["capeval clipscore"]
    long = torch.tensor([n > clip.config.text_config.max_position_embeddings
                         for n in map(len, processor.tokenizer(captions)["input_ids"])])
    diff = (cos100 - per_sample).abs()
    print(f"  max |100 cos difference| {diff[~long].max():.2e} over {int((~long).sum())} captions within the token "
          f"limit; corpus |difference| {abs(max(float(cos100.mean()), 0.0) - corpus):.2e}")
    if long.any():
        print(f"  {int(long.sum())} captions over the token limit differ by up to {diff[long].max():.2e}: torchmetrics "
              "cuts them without their end-of-text token, capeval keeps it (CLIP pools there)")


@contextlib.contextmanager
def warnings_off():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long-caption warnings of both sides, once per update
        yield


# ---------------------------------------------------------------------------------------------- coco

COCO_METRICS = ("bleu4", "meteor", "rouge_l", "cider")

# pycocoevalcap's own loop as COCOEvalCap.evaluate runs it (PTB-tokenise references, then candidates, then each
# scorer), in a process of its own: argv = captions JSONL (caption, references), output JSON. Its METEOR JVM is
# stopped and waited for at the end, so that its CPU time is counted with the process's.
STOCK_IMPORTS = """
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
"""
LOOP_SCRIPT = """
import json, sys
{imports}
rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
gts = {i: [{"caption": r} for r in row["references"]] for i, row in enumerate(rows)}
res = {i: [{"caption": row["caption"]}] for i, row in enumerate(rows)}
tokenizer = PTBTokenizer()
gts, res = tokenizer.tokenize(gts), tokenizer.tokenize(res)
out = {}
for scorer, name in ((Bleu(4), "bleu4"), (Meteor(), "meteor"), (Rouge(), "rouge_l"), (Cider(), "cider")):
    if name == "bleu4":
        score, items = scorer.compute_score(gts, res, verbose=0)
        score, items = score[3], items[3]
    else:
        score, items = scorer.compute_score(gts, res)
    out[name] = [float(score), [float(x) for x in items]]
    if name == "meteor":
        scorer.__del__()
json.dump(out, open(sys.argv[2], "w"))
"""
PEER_SCRIPT = LOOP_SCRIPT.replace("{imports}", STOCK_IMPORTS)
# The same loop as a pycocoevalcap user runs it with capeval's drop-in: the stock imports replaced by one line
# (their METEOR JVM is the process's, stopped and waited for at exit, so its CPU is counted too).
DROPIN_SCRIPT = LOOP_SCRIPT.replace(
    "{imports}", "from capeval_plugins.pycocoevalcap import Bleu, Cider, Meteor, Rouge, PTBTokenizer")


# METEOR's paraphrase index, built (or found) in $CAPEVAL_CACHE
INDEX_SCRIPT = """
from capeval_plugins.resources import meteor_table
from capeval_plugins.metrics.coco import meteor_jar
assert meteor_table.index_for(meteor_table.default_table(meteor_jar())) is not None
"""


def flickr_rows(images: int | None, distinct: bool) -> tuple[list[str], list[list[str]]]:
    """Flickr8k-Expert's rows as the benchmark scores them: one per expert rating (16,992: each caption three
    times), or the distinct (image, caption) pairs (5,664) with ``distinct``; the first ``images`` images."""
    if distinct:
        pairs = flickr_pairs(images)
        return pairs.candidates, pairs.references
    import json

    if not FLICKR.is_file():
        raise Skip(f"no Flickr8k-Expert at {FLICKR} (set CAPEVAL_BENCHDATA)")
    records = list(json.loads(FLICKR.read_text()).values())[:images]
    rows = [(j["caption"], list(r["ground_truth"])) for r in records for j in r["human_judgement"]]
    return [c for c, _ in rows], [refs for _, refs in rows]


def run_process(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall, CPU) seconds of a child process and of every descendant it waited for (its JVMs), from the kernel,
    and what it printed on stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"{command[:4]} failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, proc.stdout.decode()


def need_pycocoevalcap_and_java() -> None:
    """Skip a coco part without Java (the PTB tokenizer, METEOR) or pycocoevalcap."""
    import shutil

    if shutil.which("java") is None:
        raise Skip("pycocoevalcap's PTB tokenizer and METEOR need Java")
    try:
        import pycocoevalcap  # noqa: F401
    except ImportError as err:
        raise Skip(f"pycocoevalcap is not installed ({err})") from None


def coco_part(args) -> None:
    import json

    need_pycocoevalcap_and_java()

    cands, refs = flickr_rows(args.coco_images, args.coco_distinct)
    if args.coco_rows:
        cands, refs = cands[:args.coco_rows], refs[:args.coco_rows]
    # Python's bytecode written and used, as an installed package has it: a machine that sets
    # PYTHONDONTWRITEBYTECODE (this one does) otherwise makes every capeval process compile torch and transformers
    # again, about 1.6 CPU-s that no user pays (pycocoevalcap's side imports far less); one untimed run of each side
    # below writes it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="capeval-coco-") as folder:
        folder = Path(folder)
        # METEOR's paraphrase index (resources/meteor_table.py) lives in a cache of the run's: built once beforehand
        # (the steady state, timed apart), or, with --coco-first-run, in a new cache every round (each capeval
        # run then builds it, as a machine's very first run does)
        env["CAPEVAL_CACHE"] = str(folder / "cache")
        if not args.coco_first_run:
            wall, cpu, _ = run_process([sys.executable, "-c", INDEX_SCRIPT], env)
            print(f"[coco] METEOR's paraphrase index built beforehand in a process of its own: cpu {cpu:.2f} s, "
                  f"wall {wall:.2f} s")
        captions = folder / "captions.jsonl"
        captions.write_text("".join(json.dumps({"caption": c, "references": r}) + "\n" for c, r in zip(cands, refs)),
                            encoding="utf-8")
        capeval = [sys.executable, "-m", "capeval_plugins.cli", "score", *[a for m in COCO_METRICS for a in ("-m", m)],
                   "--captions", str(captions), *[a for o in args.coco_option or () for a in ("-o", o)]]
        sides = {"pycocoevalcap loop": lambda k: [sys.executable, "-c", PEER_SCRIPT, str(captions), str(folder / f"peer{k}.json")],
                 "capeval score": lambda k: capeval + ["--out", str(folder / f"ours{k}.jsonl")]}
        if args.coco_dropin:
            sides["capeval drop-in loop"] = lambda k: [sys.executable, "-c", DROPIN_SCRIPT, str(captions),
                                                       str(folder / f"dropin{k}.json")]
        print(f"[coco] {len(cands)} rows ({len(set(zip(cands, map(tuple, refs))))} distinct) of Flickr8k-Expert, "
              f"{', '.join(COCO_METRICS)}, each side a whole process (Python + its JVMs), {args.rounds} rounds"
              + (f", capeval with -o {' -o '.join(args.coco_option)}" if args.coco_option else "")
              + (", capeval building METEOR's paraphrase index every round" if args.coco_first_run else ""))
        print(f"  load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        times: dict[str, list] = {name: [] for name in sides}
        for name in sides:  # untimed: bytecode written (its own cache, so a first run's rounds still build the index)
            run_process(sides[name]("warmup"), {**env, "CAPEVAL_CACHE": str(folder / "cache-warmup")}
                        if args.coco_first_run else env)
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                if args.coco_first_run:  # a new cache for each capeval side too: each builds the index itself
                    env["CAPEVAL_CACHE"] = str(folder / f"cache{r}-{len(times[name])}-{name.replace(' ', '-')}")
                wall, cpu, printed = run_process(sides[name](r), env)
                times[name].append((wall, cpu))
                if name == "capeval score" and r == 0:
                    summary = json.loads(printed.strip().splitlines()[-1])["metrics"]
        print(f"  load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        report(times, "pycocoevalcap loop", "capeval score")
        if args.coco_dropin:
            report(times, "pycocoevalcap loop", "capeval drop-in loop")
            dropin = json.loads((folder / "dropin0.json").read_text())
        theirs = json.loads((folder / "peer0.json").read_text())
        rows = [json.loads(line) for line in (folder / "ours0.jsonl").read_text().splitlines()]
    for name in COCO_METRICS:
        mine = np.array([row[name] for row in rows], dtype=np.float64)
        peer = np.array(theirs[name][1], dtype=np.float64)
        rel = np.abs(mine - peer) / np.maximum(np.abs(peer), np.finfo(float).tiny)
        print(f"  {name:8s} corpus {summary[name]['score']:.12f} (pycocoevalcap {theirs[name][0]:.12f}, "
              f"{'bit-equal' if summary[name]['score'] == theirs[name][0] else 'differs'}); per item: "
              f"{int((mine != peer).sum())} of {len(peer)} differ, max relative difference {rel.max():.1e}")
        if args.coco_dropin:
            same = dropin[name][0] == theirs[name][0] and dropin[name][1] == theirs[name][1]
            print(f"  {name:8s} drop-in loop: corpus and every item {'bit-equal' if same else 'DIFFER'}")


@contextlib.contextmanager
def stderr_silenced():
    """The Java tools' progress lines on file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def coco_math_part(args) -> None:
    """BLEU-1..4, ROUGE-L and CIDEr-D alone, in this process, on the same PTB tokens: pycocoevalcap's scorers
    against capeval's implementation (core/coco_text.py, the corpus prepared inside the timing)."""
    need_pycocoevalcap_and_java()
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from capeval_plugins.core.coco_text import CocoCorpus
    from capeval_plugins.metrics.coco import ptb_tokenize

    cands, refs = flickr_rows(args.coco_images, args.coco_distinct)
    with stderr_silenced():
        gts = ptb_tokenize({i: r for i, r in enumerate(refs)})
        res = ptb_tokenize({i: [c] for i, c in enumerate(cands)})

    def peer():
        bleu, bleu_items = Bleu(4).compute_score(gts, res, verbose=0)
        return {"bleu": (bleu, bleu_items), "rouge_l": Rouge().compute_score(gts, res),
                "cider": Cider().compute_score(gts, res)}

    def capeval():
        corpus = CocoCorpus.from_texts([res[i][0] for i in res], [gts[i] for i in res])
        bleu, bleu_items = corpus.bleu(4)
        return {"bleu": (bleu, [bleu_items[:, k] for k in range(4)]), "rouge_l": corpus.rouge_l(),
                "cider": corpus.cider()}

    print(f"[coco-math] {len(cands)} rows, PTB-tokenised once beforehand; BLEU-1..4, ROUGE-L, CIDEr-D, "
          f"{args.rounds} rounds")
    times, results = interleaved({"pycocoevalcap scorers": peer, "capeval core.coco_text": capeval}, args.rounds)
    report(times, "pycocoevalcap scorers", "capeval core.coco_text")
    theirs, ours = results["pycocoevalcap scorers"], results["capeval core.coco_text"]
    pairs = [(f"bleu{k + 1}", ours["bleu"][0][k], theirs["bleu"][0][k], ours["bleu"][1][k], theirs["bleu"][1][k])
             for k in range(4)]
    pairs += [(name, ours[name][0], theirs[name][0], ours[name][1], theirs[name][1]) for name in ("rouge_l", "cider")]
    for name, corpus, peer_corpus, items, peer_items in pairs:
        items, peer_items = np.asarray(items, dtype=np.float64), np.asarray(peer_items, dtype=np.float64)
        print(f"  {name:8s} corpus {'bit-equal' if corpus == peer_corpus else f'differs by {abs(corpus - peer_corpus):.1e}'}; "
              f"per item: {int((items != peer_items).sum())} of {len(items)} differ")


# ---------------------------------------------------------------------------------------------- mid

def official_logdet(matrix: torch.Tensor) -> torch.Tensor:
    """The official code's log-determinant: the sum of the logs of the singular values."""
    return torch.linalg.svd(matrix, full_matrices=False).S.log().sum()


def official_trace_term(cov: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """tr(cov^-1 other) as the official code forms it: an explicit inverse, the full product, its trace."""
    return (torch.linalg.inv(cov) @ other).trace()


def official_mid(x: torch.Tensor, y: torch.Tensor, x0: torch.Tensor, limit: int = 30000) -> tuple[float, float]:
    """(I(X; Y), MID) as naver-ai/mid.metric computes its reduced output (metrics/mid.py, _compute_pmi with
    reduction=True), from float64 features: x the scored modality's real features, y the conditioning ones
    (row-aligned with x), x0 the scored features to evaluate, paired with the first len(x0) rows of y.
    Covariances over N - 1; x0's scatter about the *real* means over M - 1; log-determinants from singular
    values, explicit inverses. The official code also casts its result to the features' dtype at the end; that
    is left out, so a difference measures the computation, not a final rounding."""
    excess = len(x) - limit
    if excess > 0:  # the official code drops the last pairs beyond its limit, and as many scored ones
        x, y, x0 = x[:-excess], y[:-excess], x0[:-excess]
    n, m = len(x), len(x0)
    assert n >= x.shape[1], "not full rank for matrix inversion"
    z, z0 = torch.cat([x, y], -1), torch.cat([x0, y[:m]], -1)
    x_mean, y_mean = x.mean(0, keepdim=True), y.mean(0, keepdim=True)
    z_mean = torch.cat([x_mean, y_mean], -1)
    cov = lambda a, mean, k: (a - mean).T @ (a - mean) / (k - 1)  # noqa: E731
    s_x, s_y, s_z = cov(x, x_mean, n), cov(y, y_mean, n), cov(z, z_mean, n)
    s_x0, s_z0 = cov(x0, x_mean, m), cov(z0, z_mean, m)
    mi = (official_logdet(s_x) + official_logdet(s_y) - official_logdet(s_z)) / 2
    smd = (official_trace_term(s_x, s_x0) + official_trace_term(s_y, s_y) - official_trace_term(s_z, s_z0)) / 2
    return float(mi), float(mi + smd)


class OfficialMID:
    """The official MutualInformationDivergence metric's state: every feature kept, as float64, concatenated
    at compute (no streaming)."""

    def __init__(self) -> None:
        self.x: list[torch.Tensor] = []
        self.y: list[torch.Tensor] = []
        self.x0: list[torch.Tensor] = []

    def update(self, x: torch.Tensor, y: torch.Tensor, x0: torch.Tensor) -> None:
        assert x.shape == y.shape
        self.x.append(x.double())
        self.y.append(y.double())
        self.x0.append(x0.double())

    def compute(self) -> tuple[float, float]:
        return official_mid(torch.cat(self.x), torch.cat(self.y), torch.cat(self.x0))


def fit_pair_order(pairs) -> list[tuple[int, int]]:
    """(row, reference) of every fit pair, the rows' first references first: the official code pairs the i-th
    scored caption with the i-th fit pair's image, so those must be the scored rows' images, in row order.
    The fit itself does not depend on the order."""
    first = [(row, 0) for row in range(len(pairs.candidates))]
    rest = [(row, j) for row, refs in enumerate(pairs.references) for j in range(1, len(refs))]
    return first + rest


@torch.inference_mode()
def plain_image_features(model, processor, images, batch_size: int) -> torch.Tensor:
    """L2-normalised CLIP image features straight from transformers, in batches (float32)."""
    feats = []
    for part in chunks(len(images), batch_size):
        pixels = processor.image_processor(images=images[part], return_tensors="pt")["pixel_values"]
        feats.append(pooled(model.get_image_features(pixel_values=pixels)))
    return F.normalize(torch.cat(feats), dim=-1)


@torch.inference_mode()
def plain_text_features(model, processor, texts, batch_size: int) -> torch.Tensor:
    """L2-normalised CLIP text features, truncated to 77 tokens keeping the end-of-text token (as the
    official code's clip.tokenize(truncate=True) does), in batches (float32)."""
    feats = []
    for part in chunks(len(texts), batch_size):
        tokens = processor.tokenizer(texts[part], padding=True, truncation=True, max_length=77, return_tensors="pt")
        feats.append(pooled(model.get_text_features(**tokens)))
    return F.normalize(torch.cat(feats), dim=-1)


def official_pipeline(pairs, images, model, processor, batch_size: int) -> tuple[float, float]:
    """Features of every row (its image encoded once per row, its candidate, its 5 references), then the
    official metric's update and compute on the fit pairs in :func:`fit_pair_order`."""
    image_f = plain_image_features(model, processor, images, batch_size)
    cand_f = plain_text_features(model, processor, pairs.candidates, batch_size)
    order = fit_pair_order(pairs)
    ref_f = plain_text_features(model, processor, [pairs.references[r][j] for r, j in order], batch_size)
    rows = torch.tensor([r for r, _ in order])
    metric = OfficialMID()
    metric.update(ref_f, image_f[rows], cand_f)  # x: references, y: their images, x0: candidates
    return metric.compute()


def mid_part(args, models: "Models") -> None:
    from transformers import CLIPModel, CLIPProcessor

    import capeval_plugins

    pairs = flickr_pairs(args.mid_images)
    mid_model = models.mid()
    clip, processor = CLIPModel.from_pretrained(mid_model).eval(), CLIPProcessor.from_pretrained(mid_model)
    images = row_images(pairs, PHOTO_SIDE)
    ours = capeval_plugins.load("mid", model=mid_model, batch_size=args.batch_size)
    dim = clip.config.projection_dim
    if pairs.n_images <= dim:
        raise Skip(f"the fit needs more distinct images than the {dim} feature dimensions of {mid_model}; "
                   f"--mid-images {pairs.n_images} gives {pairs.n_images}")

    def capeval():
        result = ours(images, pairs.candidates, pairs.references)
        return result.corpus_extras["mutual_information"], result.score

    with torch.inference_mode(), warnings_off():
        ours.fit_reference(images[:2], pairs.references[:2])  # loads the shared model outside the timing
        plain_image_features(clip, processor, images[:2], args.batch_size)
        plain_text_features(clip, processor, pairs.candidates[:2], args.batch_size)
        print(f"[mid] {len(pairs.candidates)} pairs of {pairs.n_images} images ({PHOTO_SIDE} px), "
              f"{sum(map(len, pairs.references))} (image, reference) pairs fitted, model {mid_model} "
              f"(D = {dim}), torch threads {torch.get_num_threads()}, batch {args.batch_size}, {args.rounds} rounds")
        sides = {"official MID computation": lambda: official_pipeline(pairs, images, clip, processor,
                                                                       args.batch_size),
                 "capeval mid": capeval}
        times, results = interleaved(sides, args.rounds)
    report(times, "official MID computation", "capeval mid")
    print_mid_agreement(results["official MID computation"], results["capeval mid"])


def print_mid_agreement(theirs: tuple[float, float], ours: tuple[float, float]) -> None:
    print(f"  MID {ours[1]:.6f} (official {theirs[1]:.6f}): |difference| {abs(ours[1] - theirs[1]):.2e}, relative "
          f"{abs(ours[1] - theirs[1]) / abs(theirs[1]):.1e}; I(X; Y) |difference| {abs(ours[0] - theirs[0]):.2e}")


def synthetic_features(pairs, dim: int, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Unit float32 features shaped like the corpus: one per image, one per distinct text, texts correlated
    with their image through a shared latent (so the joint covariance has real cross terms), plus a common
    offset per modality as CLIP features have."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(pairs.n_images, dim, generator=gen, dtype=torch.float64)
    rotate = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64)).Q
    offset_i, offset_t = (torch.randn(dim, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
    images = F.normalize(offset_i + latent + 0.5 * torch.randn(pairs.n_images, dim, generator=gen,
                                                               dtype=torch.float64), dim=-1).float()
    owner = {}
    for k, cand, refs in zip(pairs.image, pairs.candidates, pairs.references):
        owner.update({text: k for text in [cand, *refs]})
    noise = torch.randn(len(owner), dim, generator=gen, dtype=torch.float64)
    owners = torch.tensor(list(owner.values()))
    texts = F.normalize(offset_t + latent[owners] @ rotate + noise, dim=-1).float()
    return images, dict(zip(owner, texts))


def capeval_mid_from_features(metric, pairs, image_f, text_f, batch_size: int):
    """The capeval metric after its encoder, as the runner drives it: per batch of rows the joint sums of
    the (image, reference) pairs and the candidate pairs' features (what MID.map returns), merged across
    batches, then finalize (the fit, per-sample PMI and the trace-form corpus MID)."""
    from capeval_plugins.contract import GROUP, INDEX, finalize_state, full_spec, merge_states
    from capeval_plugins.core import gaussian
    from capeval_plugins.metrics.mid import FIT, IMAGE, TEXT

    def parts():
        for part in chunks(len(pairs.candidates), batch_size):
            rows = range(part.start, part.stop)
            owner = torch.tensor([pairs.image[r] for r in rows for _ in pairs.references[r]])
            refs = torch.stack([text_f[t] for r in rows for t in pairs.references[r]])
            sums = gaussian.joint_sums(image_f[owner], refs)
            yield {**{FIT[k]: v for k, v in sums.items()}, IMAGE: image_f[[pairs.image[r] for r in rows]],
                   TEXT: torch.stack([text_f[pairs.candidates[r]] for r in rows]),
                   INDEX: torch.arange(part.start, part.stop), GROUP: torch.full((len(rows),), -1)}

    result = finalize_state(metric, merge_states(full_spec(metric), parts()))
    return result.corpus_extras["mutual_information"], result.score


def official_from_features(pairs, image_f, text_f, batch_size: int) -> tuple[float, float]:
    """The official metric fed batch by batch with row-aligned (reference, image) fit pairs in
    :func:`fit_pair_order` and the candidates, then computed."""
    order = fit_pair_order(pairs)
    per_batch = len(order) // len(pairs.candidates)  # fit pairs per row: 5 references each
    metric = OfficialMID()
    for part in chunks(len(pairs.candidates), batch_size):
        fit = order[part.start * per_batch:part.stop * per_batch]
        metric.update(torch.stack([text_f[pairs.references[r][j]] for r, j in fit]),
                      image_f[[pairs.image[r] for r, _ in fit]],
                      torch.stack([text_f[pairs.candidates[r]] for r in range(part.start, part.stop)]))
    return metric.compute()


def mid_math_part(args, models: "Models") -> None:
    import capeval_plugins

    pairs = flickr_pairs(None)
    if len({len(r) for r in pairs.references}) != 1:
        raise Skip("every row needs the same number of references to feed the official metric in aligned batches")
    model = models.main()
    metric = capeval_plugins.load("mid", model=model)
    dim = metric.dim
    image_f, text_f = synthetic_features(pairs, dim)
    print(f"[mid-math] {len(pairs.candidates)} scored pairs, {sum(map(len, pairs.references))} fitted, synthetic "
          f"features of D = {dim} ({model}'s size), torch threads {torch.get_num_threads()}, {args.rounds} rounds")
    sides = {"official MID computation": lambda: official_from_features(pairs, image_f, text_f, args.batch_size),
             "capeval mid (after encoder)": lambda: capeval_mid_from_features(metric, pairs, image_f, text_f,
                                                                              args.batch_size)}
    with torch.inference_mode():
        times, results = interleaved(sides, args.rounds)
    report(times, "official MID computation", "capeval mid (after encoder)")
    print_mid_agreement(results["official MID computation"], results["capeval mid (after encoder)"])


# ---------------------------------------------------------------------------------------------- main

class Models:
    """The CLIP checkpoints of the parts: given, or random ones built on first use in a temporary folder."""

    def __init__(self, args, workdir: Path) -> None:
        self.args, self.workdir = args, workdir

    def built(self, kind: str) -> str:
        from capeval_plugins.testing import build_tiny

        path = self.workdir / kind
        if not path.is_dir():
            build_tiny(kind, path)
        return str(path)

    def main(self) -> str:
        """clipscore's and mid-math's: the random full-size ViT-B/32, or the tiny CLIP with --quick."""
        return self.args.model or self.built("clip" if self.args.quick else "clip_vit_b32")

    def mid(self) -> str:
        return self.args.mid_model or self.built("clip")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), metavar="PART",
                        help=f"parts to run, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny CLIP everywhere and few rows: checks the script end to end")
    parser.add_argument("--model", metavar="PATH", help="CLIP for clipscore and mid-math (default: random full-size ViT-B/32 "
                                        "built in a temporary folder, about 500 MB; tiny with --quick)")
    parser.add_argument("--mid-model", metavar="PATH", help="CLIP for the mid part (default: the tiny random CLIP)")
    parser.add_argument("--clip-images", type=int, metavar="N", help="Flickr8k images for clipscore (default 40, quick 8)")
    parser.add_argument("--coco-images", type=int, metavar="N", help="Flickr8k images for coco (default all 1000, quick 30)")
    parser.add_argument("--coco-option", action="append", metavar="KEY=VALUE",
                        help="an option for capeval's side of coco, as `capeval score -o` (e.g. meteor.jvms=2)")
    parser.add_argument("--coco-rows", type=int, metavar="N", help="only the first N rows for coco (e.g. 500)")
    parser.add_argument("--coco-dropin", action="store_true",
                        help="coco: also time pycocoevalcap's loop with capeval's drop-in scorers imported instead")
    parser.add_argument("--coco-first-run", action="store_true",
                        help="coco with METEOR's paraphrase index built inside every capeval round (a machine's first "
                             "run) instead of once beforehand")
    parser.add_argument("--coco-distinct", action="store_true",
                        help="coco on the 5,664 distinct pairs instead of all 16,992 rows (one per expert rating)")
    parser.add_argument("--mid-images", type=int, metavar="N", help="Flickr8k images for mid (default 200, quick 40)")
    parser.add_argument("--rounds", type=int, metavar="N", help="interleaved rounds per part (default 3, quick 1)")
    parser.add_argument("--threads", type=int, metavar="N", default=1, help="torch threads, fixed for both sides (default 1)")
    parser.add_argument("--batch-size", type=int, metavar="N", default=64, help="rows per batch on both sides (default 64)")
    args = parser.parse_args()
    defaults = dict(clip_images=(40, 8), coco_images=(None, 30), mid_images=(200, 40), rounds=(3, 1))
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="capeval-peers-") as workdir:
        models = Models(args, Path(workdir))
        runs = {"clipscore": clipscore_part, "coco": lambda args, _: coco_part(args),
                "coco-math": lambda args, _: coco_math_part(args), "mid": mid_part,
                "mid-math": mid_math_part}
        for part in args.parts:
            try:
                runs[part](args, models)
            except Skip as why:
                print(f"[{part}] skipped: {why}")
            sys.stdout.flush()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
