"""The readers of the released PAC-S / PAC-S++ / Polos checkpoints (``capeval convert pacs|polos``) against crafted
files: nothing in a file runs code, climbs out of the archive, or makes the converter allocate more than the file
holds; each refusal is one line (exit 2 on the CLI); and the converter writes only through the file layer.

The archives are written here opcode by opcode where ``torch.save`` would not write them (a persistent id, a
rebuild call or a zip member of the attacker's choosing), so each case is the file an attacker would ship.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from capeval_plugins.cli import main
from capeval_plugins.commands.convert import ConversionError
from capeval_plugins.commands.convert_official import convert_pacs, convert_polos, read_released, released_state_dict
from capeval_plugins.testing import official

pytestmark = pytest.mark.filterwarnings("ignore")
FOUR = np.arange(4, dtype=np.float32).tobytes()


class Storage:
    """A storage as a checkpoint's pickle names it: ``("storage", type, key, location, numel)``."""

    def __init__(self, key: str, numel: int, kind=torch.FloatStorage) -> None:
        self.key, self.numel, self.kind = key, numel, kind


class Call:
    """Pickles as ``fn(*args)`` (a REDUCE); callable so that it may itself be the function of another Call."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args

    def __call__(self, *args):  # never called here: pickle only checks that a REDUCE's function is callable
        raise AssertionError


class Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", obj.kind, obj.key, "cpu", obj.numel) if isinstance(obj, Storage) else None


def tensor(storage: Storage, offset: int, size: tuple, stride: tuple) -> Call:
    return Call(torch._utils._rebuild_tensor_v2, storage, offset, size, stride, False, collections.OrderedDict())


def archive(path: Path, obj, records: dict[str, bytes] | None = None, members: dict[str, bytes] | None = None,
            compress: int = zipfile.ZIP_STORED) -> Path:
    """A checkpoint in torch.save's zip layout holding ``obj``'s pickle, the storage ``records`` and ``members``."""
    pickled = io.BytesIO()
    Pickler(pickled, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickled.getvalue())
        z.writestr("archive/byteorder", "little")
        for key, data in (records if records is not None else {"0": FOUR}).items():
            z.writestr(f"archive/data/{key}", data, compress_type=compress)
        for name, data in (members or {}).items():
            z.writestr(name, data)
        z.writestr("archive/version", "3\n")
    return path


def legacy(path: Path, obj, numel: int) -> Path:
    """A checkpoint in torch's pre-1.6 format (magic number, pickles, then each storage's size and bytes)."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    class LegacyPickler(pickle.Pickler):
        def persistent_id(self, o):
            return ("storage", torch.FloatStorage, "0", "cpu", numel, None) if isinstance(o, Storage) else None

    out = io.BytesIO()
    for header in (MAGIC_NUMBER, PROTOCOL_VERSION, {"protocol_version": 1001, "little_endian": True, "type_sizes": {}}):
        pickle.dump(header, out, protocol=2)
    LegacyPickler(out, protocol=2).dump(obj)
    pickle.dump(["0"], out, protocol=2)
    out.write(struct.pack("<q", 4) + FOUR)
    path.write_bytes(out.getvalue())
    return path


def refused(path: Path, match: str = "") -> str:
    """Both converters refuse ``path`` with one line (``match`` in it) and write nothing."""
    messages = []
    for convert in (convert_pacs, convert_polos):
        with pytest.raises(ConversionError, match=match) as err:
            convert(path, path.parent / "out")
        assert "\n" not in str(err.value)
        messages.append(str(err.value))
    assert not (path.parent / "out").exists()
    return messages[0]


def test_the_crafting_is_faithful(tmp_path):
    """The hand-made archive is one torch reads back (so a refusal below is the case's, not the crafting's)."""
    path = archive(tmp_path / "ok.pth", {"state_dict": {"w": tensor(Storage("0", 4), 0, (4,), (1,))}})
    state, _, _ = released_state_dict(path)
    assert torch.equal(state["w"], torch.arange(4.0))


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec", "builtins.eval", "subprocess.call",
                                     "getattr(__import__('os'), 'system')"])
def test_code_in_a_pickle_is_refused_without_running(tmp_path, payload):
    import builtins
    import subprocess

    marker = tmp_path / "ran"
    shell = f"touch {marker}"
    python = f"open({str(marker)!r}, 'w').close()"
    call = {"os.system": Call(os.system, shell), "builtins.exec": Call(builtins.exec, python),
            "builtins.eval": Call(builtins.eval, python), "subprocess.call": Call(subprocess.call, ["touch", str(marker)]),
            # the chained form: the function itself comes out of calls to builtins
            "getattr(__import__('os'), 'system')": Call(Call(builtins.getattr, Call(builtins.__import__, "os"), "system"),
                                                          shell)}[payload]
    path = archive(tmp_path / "x.pth", {"state_dict": {"w": tensor(Storage("0", 4), 0, (4,), (1,))}, "x": call})
    assert "refused" in refused(path, "which could run code")
    assert not marker.exists()


def test_lightning_names_are_inert_even_when_they_resolve_to_code(tmp_path, monkeypatch):
    """A global under ``pytorch_lightning.`` is read as an inert stand-in, never imported: here the name
    resolves to a function that runs (``torch.load(weights_only=False)`` runs it: the file is live), and
    read_released neither imports nor calls it."""
    marker = tmp_path / "ran"
    package, module = types.ModuleType("pytorch_lightning"), types.ModuleType("pytorch_lightning.callbacks")

    def system(path):
        Path(path).touch()

    system.__module__, system.__qualname__ = module.__name__, "system"
    module.system, package.callbacks = system, module
    monkeypatch.setitem(sys.modules, "pytorch_lightning", package)
    monkeypatch.setitem(sys.modules, "pytorch_lightning.callbacks", module)
    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.ones(2)}, "callbacks": Call(system, str(marker))}, buffer)
    (tmp_path / "x.ckpt").write_bytes(buffer.getvalue())
    torch.load(tmp_path / "x.ckpt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    loaded, stand_ins = read_released(tmp_path / "x.ckpt")
    assert stand_ins == ["pytorch_lightning.callbacks.system"] and not marker.exists()
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(2)) and type(loaded["callbacks"]).__name__ == "system"


U = torch._utils
ODD = {  # torch's own rebuild functions (on its weights_only list) with arguments torch.save never writes
    "a size past the storage": (tensor(Storage("0", 4), 0, (100,), (1,)), "not a PyTorch checkpoint"),
    "a negative stride": (tensor(Storage("0", 4), 3, (4,), (-1,)), "not a PyTorch checkpoint"),
    "a negative offset": (tensor(Storage("0", 4), -2, (4,), (1,)), "not a PyTorch checkpoint"),
    "an integer for a storage": (Call(U._rebuild_tensor_v2, 7, 0, (4,), (1,), False, collections.OrderedDict()),
                                 "not a PyTorch checkpoint"),
    "a parameter of a number": (Call(U._rebuild_parameter, 5, False, collections.OrderedDict()),
                                "not a PyTorch checkpoint"),
    "a parameter whose state sets data": (
        Call(U._rebuild_parameter_with_state, tensor(Storage("0", 4), 0, (4,), (1,)), False,
             collections.OrderedDict(), ({"data": 3}, None)), "not a PyTorch checkpoint"),
    "a wrapper subclass of 1e12 numbers": (
        Call(U._rebuild_wrapper_subclass, torch.Tensor, torch.float32, (10**6, 10**6), (10**6, 1), 0, torch.strided,
             torch.device("cpu"), False), "not a PyTorch checkpoint"),
    "a numpy rebuild of a number": (Call(U._rebuild_device_tensor_from_numpy, 7, torch.float32, "cpu", False),
                                    "not a PyTorch checkpoint"),
    "a meta tensor of 1e12 numbers": (Call(U._rebuild_meta_tensor_no_storage, torch.float32, (10**6, 10**6),
                                           (10**6, 1), False), "on meta"),
    "a sparse tensor indexing past its size": (
        Call(U._rebuild_sparse_tensor, torch.sparse_coo,
             (tensor(Storage("i", 2, torch.LongStorage), 0, (1, 2), (2, 1)), tensor(Storage("0", 4), 0, (2,), (1,)),
              (3,))), "sparse_coo"),
    "a complex tensor": (tensor(Storage("0", 2, torch.ComplexFloatStorage), 0, (2,), (1,)), "complex64"),
    # a stride-0 view of 4 stored numbers declaring a 256 MB matrix: copied (.float().contiguous()) it allocated
    # 256 MB from a 1 MB file before the shapes were compared; 50,000 x 50,000 would be 10 GB
    "an expanded view": (tensor(Storage("0", 4), 0, (8192, 8192), (0, 0)), "overlapping view"),
}


@pytest.mark.parametrize("case", ODD)
def test_rebuild_functions_with_odd_arguments_are_one_line_refusals(tmp_path, case):
    obj, match = ODD[case]
    index = np.array([[0, 10**9]], dtype=np.int64).tobytes()
    refused(archive(tmp_path / "x.pth", {"state_dict": {"w": obj}}, {"0": FOUR, "i": index}), match)


def test_views_of_one_storage_may_not_declare_more_than_the_file(tmp_path):
    """Each view within its storage, but 4096 distinct views of one 64 KiB storage (256 MiB once copied) are more
    than the file holds; tied weights (one view under two names) count once and pass."""
    data = np.zeros(16384, dtype=np.float32).tobytes()
    whole = Storage("0", 16384)
    views = {f"w{i}": tensor(whole, i % 7, (16384 - 7,), (1,)) for i in range(4096)}
    refused(archive(tmp_path / "x.pth", {"state_dict": views}, {"0": data}), "more than the file")
    tied = {"a": tensor(whole, 0, (16384,), (1,)), "b": tensor(whole, 0, (16384,), (1,))}
    state, _, _ = released_state_dict(archive(tmp_path / "tied.pth", {"state_dict": tied}, {"0": data}))
    assert state["a"].data_ptr() == state["b"].data_ptr()


@pytest.mark.parametrize("numel", [10**12, 1000])
def test_a_declared_storage_size_other_than_the_record_is_refused(tmp_path, numel):
    """The pickle declares 1e12 (or 1000) numbers for a 16-byte record: torch compares them before allocating."""
    path = archive(tmp_path / "x.pth", {"state_dict": {"w": tensor(Storage("0", numel), 0, (4,), (1,))}})
    assert "record size" in refused(path, "not a PyTorch checkpoint")


@pytest.mark.parametrize("numel", [10**12, 2**28])
def test_pre_zip_format_with_a_huge_declared_storage_is_refused(tmp_path, numel):
    """Torch's pre-1.6 format allocates the declared size before reading the bytes (untouched pages, here 4 TB
    refused by the allocator, 1 GiB reserved and freed); the file is refused either way."""
    path = legacy(tmp_path / "x.pth", {"state_dict": {"w": tensor(Storage("0", numel), 0, (4,), (1,))}}, numel)
    refused(path, "not a PyTorch checkpoint")
    good = legacy(tmp_path / "ok.pth", {"state_dict": {"w": tensor(Storage("0", 4), 0, (4,), (1,))}}, 4)
    assert torch.equal(released_state_dict(good)[0]["w"], torch.arange(4.0))


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/absolute", "archive/data/../../../escaped",
                                  "archive\\..\\..\\escaped", "C:/escaped"])
def test_zip_members_outside_the_archive_are_refused(tmp_path, name):
    """torch never extracts members, but a name that climbs out is no file torch.save writes: refused from the
    listing, before torch reads the archive; nothing is written anywhere."""
    (tmp_path / "sub").mkdir()
    path = archive(tmp_path / "sub" / "x.pth", {"state_dict": {"w": tensor(Storage("0", 4), 0, (4,), (1,))}},
                   members={name: b"x"})
    refused(path, "outside the archive")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["sub", "x.pth"]


def test_a_storage_key_climbing_out_of_the_archive_reads_nothing_outside(tmp_path):
    (tmp_path / "secret").write_bytes(FOUR)
    key = "../" * 8 + str(tmp_path / "secret").lstrip("/")
    path = archive(tmp_path / "x.pth", {"state_dict": {"w": tensor(Storage(key, 4), 0, (4,), (1,))}}, records={})
    assert "failed locating file" in refused(path, "not a PyTorch checkpoint")


def test_a_compressed_member_is_refused_without_inflating_it(tmp_path):
    """A zip bomb: 64 MiB of zeros deflated to 64 KiB, declared consistently; torch.save never compresses, but
    torch.load inflates such a member (shown on a small one)."""
    small = archive(tmp_path / "small.pth", {"w": tensor(Storage("0", 4), 0, (4,), (1,))}, compress=zipfile.ZIP_DEFLATED)
    assert torch.equal(torch.load(small, weights_only=True)["w"], torch.arange(4.0))
    n = 16 * 2**20
    path = archive(tmp_path / "x.pth", {"state_dict": {"w": tensor(Storage("0", n), 0, (n,), (1,))}},
                   records={"0": bytes(4 * n)}, compress=zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 2**20
    assert str(4 * n) in refused(path, "is compressed")


def test_non_finite_weights_are_refused(tmp_path):
    path = archive(tmp_path / "x.pth", {"state_dict": {"w": tensor(Storage("0", 4), 0, (4,), (1,))}},
                   records={"0": np.array([0, 1, np.nan, 3], dtype=np.float32).tobytes()})
    refused(path, "NaN or infinite")


def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path, capsys):
    import builtins

    path = archive(tmp_path / "x.pth", {"state_dict": {}, "x": Call(builtins.exec, "1")})
    for kind in ("pacs", "polos", "vela"):
        assert main(["convert", kind, str(path), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert "builtins.exec" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


# --- writing only through the file layer -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    bpe = official.write_bpe(root / "bpe.txt.gz")
    return official.released_pacs(root / "clip_ViT-B-32.pth", bpe=bpe), bpe


def tree(root: Path) -> dict[str, bytes | str]:
    return {str(p.relative_to(root)): (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


def test_the_converter_writes_its_destination_and_nothing_else(tmp_path, released, monkeypatch):
    source, bpe = released
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mine.txt").write_text("the user's")
    before = tree(tmp_path)
    convert_pacs(source, tmp_path / "work" / "out", "vit-b-32", str(bpe))
    after = tree(tmp_path)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert changed and all(k.startswith("work/out") for k in changed), changed
    assert (tmp_path / "work" / "out" / "model.safetensors").is_file()
    # --overwrite replaces what the conversion wrote, and only that
    (tmp_path / "work" / "out" / "notes.txt").write_text("the user's too")
    convert_pacs(source, tmp_path / "work" / "out", "vit-b-32", str(bpe), overwrite=True)
    assert (tmp_path / "work" / "out" / "notes.txt").read_text() == "the user's too"


def test_destinations_the_package_does_not_own_are_refused(tmp_path, released):
    source, bpe = released
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere, target_is_directory=True)
    (tmp_path / "file").write_text("x")
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_text("{}")
    for destination in (tmp_path / "link", tmp_path / "file", source, user):
        before = tree(tmp_path)
        with pytest.raises(ConversionError):
            convert_pacs(source, destination, "vit-b-32", str(bpe), overwrite=True)
        assert tree(tmp_path) == before, destination
