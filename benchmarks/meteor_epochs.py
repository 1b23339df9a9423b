"""METEOR in a validation loop: every epoch new captions of the same images, scored by one process.

    python benchmarks/meteor_epochs.py                  # 10 epochs of 1,000 images, both paraphrase tables
    python benchmarks/meteor_epochs.py --epochs 30 --images 300

What a Lightning ``validation_step`` does with capeval's torchmetrics ``METEOR``: ``update`` per batch of 100,
``compute`` at the end of the epoch, ``reset``. The captions of epoch e are Flickr8k-Expert candidates of each
image with words dropped and swapped (fewer as the epochs go on, as a model's outputs settle), seeded by
(epoch, image); the references stay (the image's 5). Each side is a process of its own with its own METEOR
JVMs: ``paraphrases="full"`` (the jar's table, loaded once) against ``"corpus"`` (the table cut down to each
epoch's corpus; JVMs kept while their table serves, replaced by ones on the union when not; resources/java.py).
METEOR's paraphrase index is built beforehand (the steady state). Printed per side: CPU seconds of the
process and its JVMs (live JVMs read from /proc) after each epoch, in total, and how many JVMs were started;
the scores of both sides must be equal.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", ROOT.parent / "shared" / "benchdata"))
FLICKR = BENCHDATA / "flickr8k_expert" / "flickr8k.json"

LOOP = r"""
import json, os, random, resource, sys
from capeval_plugins.resources import java
from capeval_plugins.torchmetrics import METEOR

flickr, images, epochs, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
records = list(json.load(open(flickr)).values())[:images]
refs = [list(r["ground_truth"]) for r in records]
cands = [[j["caption"] for j in r["human_judgement"]] for r in records]
vocab = sorted({w for rs in refs for r in rs for w in r.lower().split()})
ticks = os.sysconf("SC_CLK_TCK")


def cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime
    for jvm in java.METEOR.jvms:  # running JVMs: not yet in RUSAGE_CHILDREN
        try:
            fields = open(f"/proc/{jvm.child.proc.pid}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
        except OSError:
            pass
    return total


def caption(image: int, epoch: int) -> str:
    rng = random.Random(epoch * 100_003 + image)
    words = rng.choice(cands[image]).split()
    noise = 0.5 / (1 + epoch)
    words = [rng.choice(vocab) if rng.random() < noise else w for w in words if rng.random() >= noise / 2]
    return " ".join(words) or "a"


metric = METEOR(paraphrases=mode)
starts, out = 0, []
for epoch in range(epochs):
    for lo in range(0, images, 100):
        batch = range(lo, min(images, lo + 100))
        metric.update(None, [caption(i, epoch) for i in batch], [refs[i] for i in batch], ids=list(batch))
    score = float(metric.compute())
    out.append({"epoch": epoch, "cpu": cpu(), "score": score, "table": java.METEOR.used})
    metric.reset()
java.METEOR.stop()
print(json.dumps({"epochs": out, "cpu": cpu(), "corpus_tables": java.METEOR.corpus_tables}))
"""

INDEX = r"""
from capeval_plugins.resources import meteor_table
from capeval_plugins.metrics.coco import meteor_jar
assert meteor_table.index_for(meteor_table.default_table(meteor_jar())) is not None
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--images", type=int, default=1000)
    args = parser.parse_args()
    if not FLICKR.is_file():
        sys.exit(f"no Flickr8k-Expert at {FLICKR} (set CAPEVAL_BENCHDATA)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "CAPEVAL_QUIET": "1"}
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="capeval-meteor-epochs-") as folder:
        env["CAPEVAL_CACHE"] = folder
        subprocess.run([sys.executable, "-c", INDEX], env=env, check=True)
        results = {}
        for mode in ("full", "corpus"):
            done = subprocess.run([sys.executable, "-c", LOOP, str(FLICKR), str(args.images), str(args.epochs), mode],
                                  env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{args.epochs} epochs of {args.images} images (1 caption each, 5 references), one process per side")
    for mode, result in results.items():
        cumulative = [e["cpu"] for e in result["epochs"]]
        print(f"  paraphrases={mode:6s} cpu total {result['cpu']:6.2f} s; after epoch 1, 2, 5, all: "
              f"{cumulative[0]:.2f} {cumulative[min(1, len(cumulative) - 1)]:.2f} "
              f"{cumulative[min(4, len(cumulative) - 1)]:.2f} {cumulative[-1]:.2f} s; corpus tables loaded: "
              f"{result['corpus_tables']}; tables by epoch: {''.join(e['table'][0] for e in result['epochs'])}")
    full, corpus = ([e["score"] for e in results[m]["epochs"]] for m in ("full", "corpus"))
    print(f"  ratio full / corpus: cpu {results['full']['cpu'] / results['corpus']['cpu']:.2f}; "
          f"scores {'equal' if full == corpus else 'DIFFER'} in every epoch")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
