"""``capeval convert``, every kind (pacs, polos, vela, vilbert, expert), on releases that are not whole and on
destinations that are not the package's. Each case failed on the code before the fix: it converted with exit 0
(random LLM layers, a zero-filled member, a LoRA of zeros, a deflated pickle) or refused after writing a model
into the user's folder.

- a base LLM (``--llm``) missing weights is refused by the package's checked loader, before anything is written;
- every released zip checkpoint is checked against its members' CRC-32 (a download cut short into a pre-allocated
  file is zeros where it stopped; torch.load checks no CRC), and a compressed member is refused for every kind;
- a released safetensors file (no checksum) with a LoRA factor or a matrix of only zeros is refused;
- ``conversion.json`` is staged and checked with the other files: a refusal leaves the folder as it was.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from conftest import cli
from safetensors.torch import load_file, save_file

from capeval_plugins.testing import official
from capeval_plugins.testing.vela import released_vela

pytestmark = pytest.mark.filterwarnings("ignore")

KINDS = ("pacs", "polos", "vela", "vilbert", "expert")


@pytest.fixture(scope="module")
def release(tmp_path_factory, tiny_root):
    """One tiny release of every kind, as each is published (torch.save zips, safetensors, folders)."""
    from test_convert_expert import lora_release
    from test_lvlm import tiny_llava15

    from capeval_plugins.testing import tiny_checkpoint
    from capeval_plugins.testing.text_encoders import bert_tokenizer
    from capeval_plugins.testing.vilbert import TINY_RELEASED_CONFIG, tiny_vilbert

    root = tmp_path_factory.mktemp("releases")
    bpe = official.write_bpe(root / "bpe.txt.gz")
    roberta = tiny_checkpoint("simcse_roberta", root=tiny_root)
    vilbert = root / "vilbert"
    vilbert.mkdir()
    tokenizer = bert_tokenizer()
    tokenizer.save_pretrained(vilbert / "tokenizer")
    torch.save(tiny_vilbert(0, len(tokenizer), True)[1], vilbert / "multi_task_model.bin")
    (vilbert / "config.json").write_text(json.dumps({**TINY_RELEASED_CONFIG, "vocab_size": len(tokenizer)}))
    llava = tiny_llava15()
    lora_release(root / "expert", llava)
    return {"bpe": bpe, "roberta": roberta, "pacs": official.released_pacs(root / "clip_ViT-B-32.pth", bpe=bpe),
            "polos": official.released_polos(root / "reprod", roberta, bpe),
            "vela": released_vela(root / "vela", bpe=bpe), "vilbert": vilbert, "llava": llava,
            "expert": root / "expert"}


def copy_release(release, kind: str, where: Path) -> dict[str, Path]:
    """A private copy of ``kind``'s release: {"source": what the command is given, "zip": its torch.save zip}."""
    if kind == "pacs":
        copied = Path(shutil.copy(release["pacs"], where / "clip_ViT-B-32.pth"))
        return {"source": copied, "zip": copied}
    if kind == "polos":
        folder = Path(shutil.copytree(release["polos"].parent, where / "reprod"))
        return {"source": folder / "reprod.ckpt", "zip": folder / "reprod.ckpt"}
    if kind == "vela":
        folder = Path(shutil.copytree(release["vela"]["long_clip"].parent, where / "vela"))
        return {"source": folder / "vela_regressor.safetensors", "zip": folder / "longclip-L.pt",
                "llm": folder / "qwen"}
    if kind == "vilbert":
        folder = Path(shutil.copytree(release["vilbert"], where / "vilbert"))
        return {"source": folder / "multi_task_model.bin", "zip": folder / "multi_task_model.bin"}
    folder = Path(shutil.copytree(release["expert"], where / "expert"))
    return {"source": folder, "zip": folder / "adapter_model.bin"}


def command(release, kind: str, copy: dict[str, Path], destination: Path, *extra) -> list:
    if kind == "pacs":
        args = ["pacs", copy["source"], destination, "--backbone", "vit-b-32", "--tokenizer", release["bpe"]]
    elif kind == "polos":
        args = ["polos", copy["source"], destination, "--text-tokenizer", release["roberta"],
                "--clip-tokenizer", release["bpe"]]
    elif kind == "vela":
        args = ["vela", copy["source"], destination, "--long-clip", copy["zip"], "--llm", copy["llm"],
                "--clip-tokenizer", release["bpe"]]
    elif kind == "vilbert":
        folder = copy["source"].parent
        args = ["vilbert", copy["source"], destination, "--config", folder / "config.json",
                "--tokenizer", folder / "tokenizer"]
    else:
        args = ["expert", copy["source"], destination, "--base", release["llava"], "--dtype", "float32"]
    return ["convert", *args, *extra]


def tree(root: Path) -> dict[str, bytes | str]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir") for p in sorted(root.rglob("*"))}


def member_data(path: Path) -> dict[str, tuple[int, int, int]]:
    """{member: (data offset, size, recorded CRC-32)}, read from the local headers with struct, not zipfile."""
    data, found = path.read_bytes(), {}
    for info in zipfile.ZipFile(path).infolist():
        name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])
        found[info.filename] = (info.header_offset + 30 + name_length + extra_length, info.file_size, info.CRC)
    return found


def mismatched(path: Path) -> list[str]:
    """The members whose bytes do not have the CRC-32 the archive records, computed with zlib."""
    data = path.read_bytes()
    return [name for name, (start, size, crc) in member_data(path).items()
            if zlib.crc32(data[start: start + size]) != crc]


def zero_second_half_of_largest_tensor(path: Path) -> str:
    """What aria2 leaves of a download cut short: the file whole in size, a segment zeros (here in the largest
    tensor's storage, so the pickle still reads)."""
    members = {n: m for n, m in member_data(path).items() if "/data/" in n}
    name = max(members, key=lambda n: members[n][1])
    start, size, _ = members[name]
    data = bytearray(path.read_bytes())
    data[start + size // 2: start + size] = bytes(size - size // 2)
    path.write_bytes(bytes(data))
    return name


def refusal(code: int, err: str) -> str:
    """The one ``capeval: error:`` line, exit code 2 (transformers' progress bars may come before it)."""
    lines = err.splitlines()
    assert code == 2 and "Traceback" not in err and lines[-1].startswith("capeval: error: "), err
    assert sum("capeval: error:" in line for line in lines) == 1, err
    return lines[-1]


def refused_leaving_nothing(release, kind: str, copy: dict, tmp_path: Path, capsys, *words: str) -> str:
    before = tree(tmp_path)
    err = refusal(*cli(command(release, kind, copy, tmp_path / "out"), capsys)[::2])
    assert all(w in err for w in words), err
    assert tree(tmp_path) == before
    return err


# --- 1. the base LLM goes through the package's checked loader -------------------------------------------------------

def test_vela_refuses_a_base_llm_missing_weights_before_writing(release, tmp_path, capsys):
    copy = copy_release(release, "vela", tmp_path)
    weights = copy["llm"] / "model.safetensors"
    state = load_file(str(weights))
    dropped = sorted(k for k in state if ".layers.1.mlp." in k)
    assert len(dropped) == 3
    save_file({k: v for k, v in state.items() if k not in dropped}, str(weights), metadata={"format": "pt"})
    err = refused_leaving_nothing(release, "vela", copy, tmp_path, capsys, str(copy["llm"]))
    assert any(name.removeprefix("model.") in err for name in dropped), err


# --- 2. every released zip checkpoint's members against their CRC-32 -------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_zip_checkpoint_with_a_zero_filled_member_is_refused_naming_it(release, kind, tmp_path, capsys):
    copy = copy_release(release, kind, tmp_path)
    assert mismatched(copy["zip"]) == []
    damaged = zero_second_half_of_largest_tensor(copy["zip"])
    assert mismatched(copy["zip"]) == [damaged]
    refused_leaving_nothing(release, kind, copy, tmp_path, capsys, str(copy["zip"]), "damaged or cut short",
                            repr(damaged), "fetch it again")


@pytest.mark.parametrize("kind", ["vilbert", "expert"])
def test_a_deflated_member_is_refused_for_the_vilbert_and_expert_pickles_too(release, kind, tmp_path, capsys):
    """torch.save stores members as they are (checked here); a deflated one would be inflated by torch.load."""
    copy = copy_release(release, kind, tmp_path)
    with zipfile.ZipFile(copy["zip"]) as saved:
        assert {m.compress_type for m in saved.infolist()} == {zipfile.ZIP_STORED}
        members = [(m.filename, saved.read(m)) for m in saved.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as deflated:
        for name, data in members:
            deflated.writestr(name, data)
    copy["zip"].write_bytes(buffer.getvalue())
    assert torch.load(copy["zip"], weights_only=True)  # torch itself reads it
    refused_leaving_nothing(release, kind, copy, tmp_path, capsys, str(copy["zip"]), "is compressed")


def test_a_zip_checkpoint_cut_short_at_its_listing_says_so(release, tmp_path, capsys):
    copy = copy_release(release, "pacs", tmp_path)
    data = bytearray(copy["zip"].read_bytes())
    data[-1024:] = bytes(1024)  # the central directory is the last thing a download writes
    copy["zip"].write_bytes(bytes(data))
    refused_leaving_nothing(release, "pacs", copy, tmp_path, capsys, "damaged or cut short", "fetch it again")


def test_a_zip_checkpoint_recording_no_crc_is_refused(release, tmp_path, capsys):
    from torch.utils.serialization import config

    copy = copy_release(release, "pacs", tmp_path)
    state = torch.load(copy["zip"], weights_only=True)
    buffer = io.BytesIO()
    config.save.compute_crc32 = False
    try:
        torch.save(state, buffer)
    finally:
        config.save.compute_crc32 = True
    copy["zip"].write_bytes(buffer.getvalue())
    assert {info.CRC for info in zipfile.ZipFile(copy["zip"]).infolist()} == {0}
    refused_leaving_nothing(release, "pacs", copy, tmp_path, capsys, "record no CRC-32")


# --- 3. released safetensors (no checksum): no LoRA factor or matrix of only zeros -----------------------------------

def zero_after_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = bytes(len(data) - start)
    path.write_bytes(bytes(data))


def adapter_as_safetensors(folder: Path, change=lambda name, tensor: tensor) -> None:
    factors = torch.load(folder / "adapter_model.bin", weights_only=True)
    (folder / "adapter_model.bin").unlink()
    save_file({k: change(k, v).contiguous() for k, v in factors.items()}, str(folder / "adapter_model.safetensors"))


def test_expert_refuses_a_zero_filled_adapter(release, tmp_path, capsys):
    copy = copy_release(release, "expert", tmp_path)
    adapter_as_safetensors(copy["source"])
    zero_after_header(copy["source"] / "adapter_model.safetensors")
    assert not any(t.any() for t in load_file(str(copy["source"] / "adapter_model.safetensors")).values())
    refused_leaving_nothing(release, "expert", copy, tmp_path, capsys, "adapter_model.safetensors", ".lora_",
                            "holds only zeros")


def test_expert_refuses_an_adapter_whose_b_factors_are_zeros(release, tmp_path, capsys):
    """peft's initial adapter (B = 0): it folds in nothing, whatever A holds."""
    copy = copy_release(release, "expert", tmp_path)
    adapter_as_safetensors(copy["source"], lambda name, t: torch.zeros_like(t) if ".lora_B." in name else t)
    err = refused_leaving_nothing(release, "expert", copy, tmp_path, capsys, "adapter_model.safetensors",
                                  "holds only zeros")
    assert ".lora_B." in err and ".lora_A." not in err


def test_vela_refuses_a_zero_filled_regressor(release, tmp_path, capsys):
    copy = copy_release(release, "vela", tmp_path)
    zero_after_header(copy["source"])
    refused_leaving_nothing(release, "vela", copy, tmp_path, capsys, "vela_regressor.safetensors", "holds only zeros")


# --- 4. conversion.json is staged with the rest: a refusal changes nothing -------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_users_conversion_json_refuses_the_conversion_before_anything_is_written(release, kind, tmp_path, capsys):
    copy = copy_release(release, kind, tmp_path)
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "conversion.json").write_text('{"mine": 1}')
    (user / "notes.txt").write_text("the user's")
    before = tree(tmp_path)
    err = refusal(*cli(command(release, kind, copy, user, "--overwrite"), capsys)[::2])
    assert f"{user} already has conversion.json" in err and "cannot load checkpoint" not in err
    assert tree(tmp_path) == before
    assert sorted(os.listdir(user)) == ["conversion.json", "notes.txt"]
