"""The leading-space rule of byte-level BPE tokenizers, against bert_score on tiny RoBERTa checkpoints, on the
installed transformers and (opt-in) on another one, e.g. the lowest the pins allow (4.57.x).

bert_score asks RoBERTa/GPT-2 tokenizers for ``add_prefix_space=True`` per call. transformers 4.57 honours the
request (bert_score loads the slow ``RobertaTokenizer``), 5.x ignores it, so there bert_score gets the space only
from a tokenizer saved with it. Ours (the default ``prefix_space="paper"``) decides by the tokenizer's class, as
bert_score does (``bert_score_prefix_space``), and adds the space itself, which a tokenizer saved with the space
does not double. The other-version run: ``CAPEVAL_OTHER_TRANSFORMERS_PYTHON=<python of a venv with
transformers==4.57.* and bert_score==0.3.13>`` (see docs/testing.md)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD

import capeval_plugins

bert_score = pytest.importorskip("bert_score")
HELPER = Path(__file__).parent / "helpers" / "bertscore_other_transformers.py"
from test_bertscore import CANDIDATES, REFERENCES  # noqa: E402


def with_legacy_files(folder: Path) -> Path:
    """vocab.json and merges.txt next to tokenizer.json, so slow tokenizers (bert_score's) load on any version."""
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    (folder / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return folder


@pytest.fixture(scope="module")
def robertas(tiny_root, tmp_path_factory) -> dict[str, str]:
    """The tiny RoBERTa as built (no prefix-space setting) and a copy whose tokenizer is saved with it."""
    from transformers import AutoTokenizer

    from capeval_plugins.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("robertas")
    bare = root / "bare"
    shutil.copytree(tiny_checkpoint("roberta", root=tiny_root), bare)
    spaced = root / "spaced"
    shutil.copytree(bare, spaced)
    AutoTokenizer.from_pretrained(bare, add_prefix_space=True).save_pretrained(spaced)
    return {"bare": str(with_legacy_files(bare)), "spaced": str(with_legacy_files(spaced))}


def encoder(path: str):
    from capeval_plugins.models.encoders.common import EncoderSpec
    from capeval_plugins.models.encoders.text import TextEncoder

    return TextEncoder.shared(EncoderSpec(path))


def test_the_first_word_gets_exactly_one_leading_space(robertas, tiny_root):
    from capeval_plugins.testing import tiny_checkpoint

    bare, spaced = encoder(robertas["bare"]), encoder(robertas["spaced"])
    assert bare.prefix_space and spaced.prefix_space  # RoBERTa's class: spaced, never twice (below)
    for enc in (bare, spaced):
        tokens = enc.tokenizer.convert_ids_to_tokens(enc.tokenize(["  a dog"])[0])
        assert tokens[1:-1] == ["Ġa", "Ġdog"]
    assert not encoder(str(tiny_checkpoint("deberta_v3", root=tiny_root))).prefix_space  # SentencePiece: never


@pytest.mark.parametrize("idf", [False, True])
def test_a_tokenizer_saved_with_the_space_equals_bert_score_as_installed(robertas, idf):
    p, r, f = bert_score.score(CANDIDATES, REFERENCES, model_type=robertas["spaced"], num_layers=2, idf=idf,
                               nthreads=0)
    result = capeval_plugins.load("bertscore", model=robertas["spaced"], num_layers=2, idf=idf)(None, CANDIDATES,
                                                                                              REFERENCES)
    got = torch.stack([result.extras["precision"], result.extras["recall"], result.scores], -1)
    torch.testing.assert_close(got, torch.stack([p, r, f], -1).double(), atol=1e-5, rtol=0)


@pytest.mark.skipif(not os.environ.get("CAPEVAL_OTHER_TRANSFORMERS_PYTHON"),
                    reason="opt-in: CAPEVAL_OTHER_TRANSFORMERS_PYTHON=<python with transformers 4.57.x + bert_score>")
def test_on_another_transformers_version_equals_bert_score_as_installed_there(robertas):
    python = os.environ["CAPEVAL_OTHER_TRANSFORMERS_PYTHON"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([python, str(HELPER), robertas["bare"], robertas["spaced"]], capture_output=True, text=True,
                          env=env, timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)  # the version and tokenizer class it ran with (pytest -s shows it)
    assert len(report["runs"]) == 4
    for run in report["runs"]:
        assert run["first_tokens"][1:-1] == ["Ġa", "Ġdog"], run
        assert run["max_diff"] < 1e-5, run
