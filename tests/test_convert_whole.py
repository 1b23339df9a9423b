"""Issue 49, items 2, 4 and 6 for ``capeval convert``: released checkpoints that are not whole (a float8 weight, a
zero-width convolution, a Polos bias without its weight, an unknown key, a scalar-mix parameter missing or of the
wrong size) and hostile ``hparams.yaml`` files (``activations: os.system``, a deep tree, a ``!!python`` tag, a
352-byte billion laughs, a file planted beside the checkpoint) are refused in one line with exit code 2, each
failing on the code before the fix (a traceback, or gigabytes, or a silently different model)."""
from __future__ import annotations

import io
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch
from conftest import cli, one_line

from capeval_plugins.testing import official

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def release(tmp_path_factory, tiny_root):
    from capeval_plugins.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("releases")
    bpe = official.write_bpe(root / "bpe.txt.gz")
    roberta = tiny_checkpoint("simcse_roberta", root=tiny_root)
    polos = official.released_polos(root / "reprod", roberta, bpe)
    pacs = official.released_pacs(root / "clip_ViT-B-32.pth", bpe=bpe)
    return {"bpe": bpe, "roberta": roberta, "polos": polos, "pacs": pacs}


def save(checkpoint: dict, path: Path) -> Path:
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    path.write_bytes(buffer.getvalue())
    return path


def polos_copy(release, tmp_path: Path, change_state=None, hparams: str | None = None) -> Path:
    folder = tmp_path / "reprod"
    shutil.copytree(release["polos"].parent, folder)
    if change_state is not None:
        checkpoint = torch.load(release["polos"], weights_only=False)
        change_state(checkpoint["state_dict"])
        save(checkpoint, folder / "reprod.ckpt")
    if hparams is not None:
        (folder / "hparams.yaml").write_text(hparams)
    return folder / "reprod.ckpt"


def convert_polos(release, source: Path, out: Path, *extra):
    return ["convert", "polos", source, out, "--text-tokenizer", release["roberta"], "--clip-tokenizer", release["bpe"],
            *extra]


def drop(name):
    return lambda state: state.pop(name)


def put(name, value):
    return lambda state: state.__setitem__(name, value)


POLOS_STATES = {
    "a bias without its weight": (drop("ff.0.ff.linear_2.weight"), "linear_2"),
    "an unknown key": (put("ff.0.ff.dropout.weight", torch.ones(2)), "unknown parameter ff.0.ff.dropout.weight"),
    "a scalar-mix parameter missing": (drop("scalar_mix.scalar_parameters.1"), "scalar mix"),
    "a scalar-mix parameter of two values": (put("scalar_mix.scalar_parameters.1", torch.ones(2)),
                                             "scalar_mix.scalar_parameters.1 holds [2] values"),
    "a gamma of two values": (put("scalar_mix.gamma", torch.ones(2)), "scalar_mix.gamma holds [2] values"),
}


@pytest.mark.parametrize("case", sorted(POLOS_STATES))
def test_a_polos_checkpoint_that_is_not_whole_is_one_line(release, tmp_path, capsys, case):
    change, words = POLOS_STATES[case]
    code, out, err = cli(convert_polos(release, polos_copy(release, tmp_path, change), tmp_path / "out"), capsys)
    assert code == 2 and one_line(err) and words in err, (case, err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, change, words", [
    ("a float8 weight", lambda s: s.__setitem__("visual.proj", s["visual.proj"].to(torch.float8_e4m3fn)), "float8"),
    ("a zero-width convolution", lambda s: s.__setitem__("visual.conv1.weight", torch.zeros(64, 3, 0, 0)),
     "zero-size dimension"),
])
def test_a_pacs_checkpoint_with_a_float8_weight_or_a_zero_width_conv_is_one_line(release, tmp_path, capsys, case,
                                                                                 change, words):
    checkpoint = torch.load(release["pacs"], weights_only=True)
    change(checkpoint["state_dict"])
    source = save(checkpoint, tmp_path / "x.pth")
    code, _, err = cli(["convert", "pacs", source, tmp_path / "out", "--backbone", "vit-b-32", "--tokenizer",
                        release["bpe"]], capsys)
    assert code == 2 and one_line(err) and words in err, (case, err)


# 9**9 "lol"s in about 350 bytes, read where the conversion uses a value (activations: str() walks all of it)
BILLION_LAUGHS = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
                  + "".join(f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
                            for p, c in zip("abcdefg", "bcdefgh")) + "activations: *h\n")
HOSTILE_HPARAMS = {
    "activations: os.system": ("activations: os.system\n", "os.system"),
    "a deep tree": ("tree: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than"),
    "a !!python tag": ("activations: !!python/object/apply:os.system ['touch pwned']\n", "not plain YAML"),
    "a billion laughs": (BILLION_LAUGHS, "alias"),
    "a top level that is a list": ("- activations\n- Tanh\n", "not a mapping"),
    "hidden sizes other than the weights'": ("hidden_sizes: '24,13'\n", "hidden_sizes"),
    "an unknown final activation": ("final_activation: Softmax\n", "Softmax"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HPARAMS))
def test_a_hostile_hparams_yaml_is_one_line_and_costs_nothing(release, tmp_path, capsys, case, monkeypatch):
    text, words = HOSTILE_HPARAMS[case]
    monkeypatch.chdir(tmp_path)
    source = polos_copy(release, tmp_path, hparams=text)
    tracemalloc.start()
    try:
        code, _, err = cli(convert_polos(release, source, tmp_path / "out"), capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 2 and one_line(err) and words in err, (case, err)
    assert peak < 256 * 2**20, peak  # the billion laughs expanded to 3 GiB before
    assert not (tmp_path / "pwned").exists()


def test_an_hparams_yaml_planted_by_another_user_is_refused(release, tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    source = polos_copy(release, tmp_path, hparams="activations: ReLU\n")
    os.chown(source.parent / "hparams.yaml", 4321, 4321)
    code, _, err = cli(convert_polos(release, source, tmp_path / "out"), capsys)
    assert code == 2 and one_line(err) and "another user" in err, err
    os.chown(source.parent / "hparams.yaml", 0, 0)
    code, out, err = cli(convert_polos(release, source, tmp_path / "out2", "--hparams",
                                       source.parent / "hparams.yaml"), capsys)
    assert code == 0 and "activations='ReLU'" in out, err


def test_an_hparams_yaml_disagreeing_with_the_checkpoint_is_refused(release, tmp_path, capsys):
    source = polos_copy(release, tmp_path, hparams="activations: ReLU\npool: avg\n")
    code, _, err = cli(convert_polos(release, source, tmp_path / "out"), capsys)
    assert code == 2 and one_line(err) and "pool='avg'" in err and "'cls'" in err, err


def test_the_conversion_says_which_hyper_parameters_it_read_and_where(release, tmp_path, capsys):
    source = polos_copy(release, tmp_path)
    code, out, err = cli(convert_polos(release, source, tmp_path / "out"), capsys)
    assert code == 0, err
    line = next(line for line in out.splitlines() if "hyper-parameters read" in line)
    assert "activations='Tanh'" in line and str(source.parent / "hparams.yaml") in line
    (source.parent / "hparams.yaml").unlink()
    code, out, err = cli(convert_polos(release, source, tmp_path / "out2"), capsys)
    assert code == 0 and "the checkpoint's own hyper-parameters" in out, err
