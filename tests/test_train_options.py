"""`capeval train`: every numeric option is bounded when the command line is parsed, with the bounds the training
code enforces (a value outside them was a ValueError traceback, exit 1, once training had started); a setting
the training configuration refuses only in combination, or only once a model is loaded (--vision-layer beyond the
tower's layers), is one line, exit 2; a ValueError raised outside the package stays a bug, with its traceback.

Each bound is checked against the training code itself: the dataclass (or reader) that holds the setting refuses
the value the command line refuses, and takes the value it takes."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from conftest import capeval_in_process, random_image

from capeval_plugins.core.bounds import MAX_SEED
from capeval_plugins.models.msd_aligner.model import AlignerSettings
from capeval_plugins.models.rigel import RigelSettings
from capeval_plugins.training.msd_aligner.train import AlignerConfig
from capeval_plugins.training.phase1 import Phase1Config
from capeval_plugins.training.phase2 import Phase2Config

RIGEL = ["train", "rigel", "--phase", "1", "--train", "train.jsonl", "--out", "out"]
ALIGNER = ["train", "msd-aligner", "--train", "chat.jsonl", "--out", "out"]


def rigel(field: str, kind: type = int):
    """The setting ``field`` as both phases' configurations take it."""
    return lambda text: (Phase1Config(**{field: kind(text)}), Phase2Config(**{field: kind(text)}))


def made(cls: type, field: str, kind: type = int):
    return lambda text: cls(**{field: kind(text)})


def int64(text: str) -> None:
    """A seed is stored and drawn as int64 everywhere (capeval_plugins/core/bounds.py's MAX_SEED)."""
    np.array(int(text), dtype=np.int64)


# method, option, a value refused, a value taken, what in the training code holds the setting (None: a reader's
# bound the command line already had, so no dataclass to compare)
OPTIONS = [
    (RIGEL, "--val-fraction", "1", "0.5", None),
    (RIGEL, "--score-range", "nan 1", "1 5", None),
    (RIGEL, "--num-frames", "0", "4", None),
    (RIGEL, "--video-fps", "0", "2", made(RigelSettings, "video_fps", float)),
    (RIGEL, "--video-fps", "1001", "1000", made(RigelSettings, "video_fps", float)),
    (RIGEL, "--temperature", "0", "1e-6", made(RigelSettings, "temperature", float)),
    (RIGEL, "--head-hidden", "0", "8,4", lambda t: RigelSettings(head_hidden=tuple(int(x) for x in t.split(",")))),
    (RIGEL, "--head-hidden", "x", "8", lambda t: RigelSettings(head_hidden=tuple(int(x) for x in t.split(",")))),
    (RIGEL, "--head-hidden", ",".join(["8"] * 17), ",".join(["8"] * 16),
     lambda t: RigelSettings(head_hidden=tuple(int(x) for x in t.split(",")))),
    (RIGEL, "--epochs", "0", "1", rigel("epochs")),
    (RIGEL, "--batch-size", "0", "1", rigel("batch_size")),
    (RIGEL, "--batch-size", "-2", "1", rigel("batch_size")),
    (RIGEL, "--lr", "-1", "1e-4", rigel("lr", float)),
    (RIGEL, "--lr", "0", "1e-4", rigel("lr", float)),
    (RIGEL, "--weight-decay", "-0.1", "0", rigel("weight_decay", float)),
    (RIGEL, "--patience", "-1", "1", made(Phase1Config, "patience")),
    (RIGEL, "--patience", "0", "1", made(Phase1Config, "patience")),
    (RIGEL, "--seed", "-1", "0", rigel("seed")),
    (RIGEL, "--seed", str(MAX_SEED + 1), str(MAX_SEED), int64),
    (RIGEL, "--extract-batch-size", "0", "1", made(Phase1Config, "extract_batch_size")),
    (RIGEL, "--lora-r", "0", "1", made(Phase2Config, "lora_r")),
    (RIGEL, "--lora-alpha", "0", "1", made(Phase2Config, "lora_alpha")),
    (RIGEL, "--lora-dropout", "-0.1", "0", made(Phase2Config, "lora_dropout", float)),
    (RIGEL, "--lora-dropout", "1", "0.5", made(Phase2Config, "lora_dropout", float)),
    (RIGEL, "--save-every", "0", "1", made(Phase2Config, "save_every")),
    (ALIGNER, "--limit", "0", "1", None),
    (ALIGNER, "--vision-layer", "1001", "-2", made(AlignerSettings, "vision_layer")),
    (ALIGNER, "--vision-layer", "-1001", "-1000", made(AlignerSettings, "vision_layer")),
    (ALIGNER, "--max-length", "1", "2", made(AlignerSettings, "max_length")),
    (ALIGNER, "--max-length", str(2**20 + 1), str(2**20), made(AlignerSettings, "max_length")),
    (ALIGNER, "--epochs", "0", "1", made(AlignerConfig, "epochs")),
    (ALIGNER, "--batch-size", "0", "1", made(AlignerConfig, "batch_size")),
    (ALIGNER, "--micro-batch-size", "0", "1", made(AlignerConfig, "micro_batch_size")),
    (ALIGNER, "--lr", "0", "1e-4", made(AlignerConfig, "lr", float)),
    (ALIGNER, "--weight-decay", "-1", "0", made(AlignerConfig, "weight_decay", float)),
    (ALIGNER, "--warmup-ratio", "-0.1", "0", made(AlignerConfig, "warmup_ratio", float)),
    (ALIGNER, "--warmup-ratio", "1", "0.5", made(AlignerConfig, "warmup_ratio", float)),
    (ALIGNER, "--contrastive-weight", "-1", "0", made(AlignerConfig, "contrastive_weight", float)),
    (ALIGNER, "--reconstruction-weight", "-1", "0", made(AlignerConfig, "reconstruction_weight", float)),
    (ALIGNER, "--temperature", "0", "0.07", made(AlignerConfig, "temperature", float)),
    (ALIGNER, "--max-logit-scale", "0", "100", made(AlignerConfig, "max_logit_scale", float)),
    (ALIGNER, "--seed", "-1", "0", made(AlignerConfig, "seed")),
    (ALIGNER, "--seed", str(MAX_SEED + 1), str(MAX_SEED), int64),
    (ALIGNER, "--save-every", "0", "1", made(AlignerConfig, "save_every")),
    (ALIGNER, "--extract-batch-size", "0", "1", made(AlignerConfig, "extract_batch_size")),
]


def method_parser(method: str) -> argparse.ArgumentParser:
    from capeval_plugins.cli import build_parser

    def subparsers(parser):
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    return subparsers(subparsers(build_parser())["train"])[method]


@pytest.mark.parametrize("base, option, bad, ok, owner", OPTIONS,
                         ids=[f"{b[1]}{o}={v}" for b, o, v, _, _ in OPTIONS])
def test_a_numeric_option_out_of_range_is_a_usage_error(base, option, bad, ok, owner):
    """exit 2 naming the option, before any file is read; the value the training code takes is taken."""
    refused = capeval_in_process([*base, option, *bad.split()])
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert last.startswith(f"capeval train {base[1]}: error: argument {option}"), last
    method_parser(base[1]).parse_args([*base[2:], option, *ok.split()])
    if owner is not None:
        with pytest.raises((ValueError, OverflowError)):
            owner(bad)
        owner(ok)


def test_every_numeric_option_is_bounded_and_listed():
    """No plain type=int / type=float is left (a choices list bounds --phase), and the table above covers every
    option that takes a number."""
    listed = {(base[1], option) for base, option, *_ in OPTIONS}
    for method in ("rigel", "msd-aligner"):
        for action in method_parser(method)._actions:
            if action.type in (int, float):
                assert action.choices, action.option_strings
            elif action.type is not None:
                assert (method, action.option_strings[0]) in listed, action.option_strings


def write_pairs(folder) -> None:
    (folder / "0.png").parent.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        random_image(i).save(folder / f"{i}.png")
    (folder / "chat.jsonl").write_text("".join(json.dumps({"image": f"{i}.png", "caption": "A dog."}) + "\n"
                                               for i in range(2)))
    (folder / "train.jsonl").write_text("".join(json.dumps({"image": f"{i}.png", "candidate": "A dog.",
                                                            "score": 0.5}) + "\n" for i in range(2)))


def one_line_refusal(args: list) -> str:
    """The refusal's line; above it only progress bars (transformers' "Loading weights"), no traceback."""
    done = capeval_in_process(args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("capeval: error") == 1
    assert lines[-1].startswith("capeval: error: "), done.stderr
    return lines[-1]


def test_a_combination_the_training_code_refuses_is_one_line(tmp_path, tiny_root, monkeypatch):
    """Settings each in range that the training configuration refuses together, or that only the loaded model
    shows wrong: one line, exit 2. The one-line path is for the package's own refusals: numpy's ValueError in a
    training run is a bug, raised with its traceback."""
    import capeval_plugins.training.phase1 as phase1
    from capeval_plugins.cli import main
    from capeval_plugins.testing import tiny_checkpoint

    write_pairs(tmp_path)
    rigel_args = ["train", "rigel", "--phase", "1", "--train", tmp_path / "train.jsonl", "--out", tmp_path / "r",
                  "--val-fraction", "0", "--quiet"]
    assert "score range must be (low, high) with low < high" in one_line_refusal([*rigel_args, "--score-range",
                                                                                    "5", "1"])
    aligner = ["train", "msd-aligner", "--train", tmp_path / "chat.jsonl", "--out", tmp_path / "a", "--quiet"]
    assert "loss weights must not both be zero" in one_line_refusal(
        [*aligner, "--contrastive-weight", "0", "--reconstruction-weight", "0"])
    assert "1 / temperature must be <= max_logit_scale" in one_line_refusal(
        [*aligner, "--temperature", "0.001", "--max-logit-scale", "100"])
    clip, llm = tiny_checkpoint("clip", root=tiny_root), tiny_checkpoint("llama", root=tiny_root)
    layers = json.loads((clip / "config.json").read_text())
    layers = layers.get("vision_config", layers).get("num_hidden_layers")
    assert 0 < layers < 99
    line = one_line_refusal([*aligner, "--vision-model", clip, "--llm", llm, "--vision-layer", "99"])
    assert f"vision_layer 99 is outside the {layers} layers" in line

    monkeypatch.setattr(phase1, "train_phase1", lambda *a, **k: np.zeros(2).reshape(3))
    with pytest.raises(ValueError, match="reshape"):
        main([str(a) for a in [*rigel_args, "--model", "m"]])
