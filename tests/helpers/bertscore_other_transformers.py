"""Run by tests/test_bertscore_transformers_versions.py under another interpreter (another transformers):
BERTScore against bert_score as installed there, on tiny RoBERTa checkpoints. Prints one JSON line.

    python bertscore_other_transformers.py FOLDER [FOLDER ...]
"""
from __future__ import annotations

import json
import sys
import warnings

import torch

CANDIDATES = ["A dog runs on the grass.", "  Two children play in the park!  ", "a red car next to a building"]
REFERENCES = [["A dog running on grass.", "A brown dog plays outside."], ["Kids playing in a park."],
              ["A car parked by a building.", "A red car."]]


def main() -> None:
    import bert_score
    import transformers

    from capeval_plugins.models.encoders.common import EncoderSpec
    from capeval_plugins.models.encoders.text import TextEncoder
    from capeval_plugins.metrics.bertscore import BERTScore  # the class: the package need not be installed there

    out = {"transformers": transformers.__version__, "runs": []}
    warnings.simplefilter("ignore")
    for folder in sys.argv[1:]:
        encoder = TextEncoder.shared(EncoderSpec(folder))
        for idf in (False, True):
            p, r, f = bert_score.score(CANDIDATES, REFERENCES, model_type=folder, num_layers=2, idf=idf, nthreads=0)
            theirs = torch.stack([p, r, f], -1).double()
            result = BERTScore(model=folder, num_layers=2, idf=idf)(None, CANDIDATES, REFERENCES)
            ours = torch.stack([result.extras["precision"], result.extras["recall"], result.scores], -1)
            out["runs"].append({"folder": folder, "idf": idf, "max_diff": float((ours - theirs).abs().max()),
                                "tokenizer": type(encoder.tokenizer).__name__, "leading_space": encoder.prefix_space,
                                "first_tokens": encoder.tokenizer.convert_ids_to_tokens(encoder.tokenize(["a dog"])[0])})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
