"""A model folder rewritten while a process holds the model: what was checked is what scores.

Loaders map safetensors files, so a loaded model was the file's pages: a checkpoint saved over in place (a
training run, a copy in progress) changed a model already checked, mid-run and unchecked. And the process kept a
model by its folder's path, so loading the metric again after saving new weights there scored the old ones."""
from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from safetensors.torch import save_file

import capeval_plugins
from capeval_plugins.digests import files_stamp
from capeval_plugins.resources import loading, tensorfile
from capeval_plugins.resources.loading import ModelLoadError, clear_cache
from capeval_plugins.testing import build_tiny

CAPTIONS = ["a dog on the grass", "two cats asleep", "a red car", "a man rides a horse"]


def zero_tail(path, keep: float = 0.5) -> None:
    """Zeros from ``keep`` of the file on, written in place (same inode): a download cut short or rewritten."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(int(size * keep))
        f.write(bytes(size - int(size * keep)))


def cosines(model: str, images) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capeval_plugins.load("clipscore", model=model)(images, CAPTIONS).extras["cosine"].tolist()


def test_a_loaded_model_keeps_the_values_it_was_checked_with(clip_copy):
    from transformers import AutoModel

    model = loading.load_model(AutoModel, str(clip_copy))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    zero_tail(clip_copy / "model.safetensors")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_weights_file_read_by_the_package_is_not_mapped(tmp_path):
    path = tmp_path / "head.safetensors"
    save_file({"weight": torch.arange(40_000, dtype=torch.float32).reshape(200, 200)}, str(path))
    tensors = tensorfile.load_file(path)
    zero_tail(path, keep=0.1)
    assert torch.equal(tensors["weight"], torch.arange(40_000, dtype=torch.float32).reshape(200, 200))


def test_new_weights_saved_over_a_loaded_model_are_loaded_again(clip_copy, images, tmp_path):
    first = cosines(str(clip_copy), images)
    other = tmp_path / "other"
    build_tiny("clip", other, seed=7)
    shutil.copy(other / "model.safetensors", clip_copy / "model.safetensors")
    with pytest.warns(UserWarning, match="changed since this process loaded them"):
        capeval_plugins.load("clipscore", model=str(clip_copy))(images, CAPTIONS)
    again = cosines(str(clip_copy), images)
    clear_cache()
    fresh = cosines(str(clip_copy), images)  # what a new process loads
    assert again == pytest.approx(fresh, abs=1e-12) and again != pytest.approx(first, abs=1e-6)


def test_a_model_folder_damaged_after_the_load_is_refused_not_scored(clip_copy, images):
    metric = capeval_plugins.load("clipscore", model=str(clip_copy))
    assert len(metric(images, CAPTIONS).scores) == len(CAPTIONS)
    zero_tail(clip_copy / "model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ModelLoadError, match="holds only zeros|not a valid safetensors"):
            metric(images, CAPTIONS)


def test_an_unchanged_folder_is_one_model_and_the_stamp_sees_each_file(clip_copy):
    from transformers import AutoModel

    model = loading.load_model(AutoModel, str(clip_copy))
    assert loading.load_model(AutoModel, str(clip_copy)) is model
    stamp = files_stamp(clip_copy)
    assert {entry[0] for entry in stamp} == {p.name for p in clip_copy.iterdir()}
    assert files_stamp("openai/clip-vit-base-patch32") is None  # a hub id: nothing local to stamp


def test_a_hub_model_whose_cached_commit_moved_is_loaded_again(tiny_clip, images, tmp_path, monkeypatch):
    """A hub id names whatever commit its cached ``refs/main`` points at: after a newer snapshot is fetched,
    the process loaded the model of the old commit again (its id had no stamp)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--tinyclip"
    first, second = "a" * 40, "b" * 40
    shutil.copytree(tiny_clip, repo / "snapshots" / first)
    build_tiny("clip", repo / "snapshots" / second, seed=1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(first)
    clear_cache()
    try:
        before = cosines("org/tinyclip", images)
        assert before == pytest.approx(cosines(tiny_clip, images), abs=1e-6)
        (repo / "refs" / "main").write_text(second)
        with pytest.warns(UserWarning, match="changed since this process loaded them"):
            capeval_plugins.load("clipscore", model="org/tinyclip")(images, CAPTIONS)
        after = cosines("org/tinyclip", images)
        assert after == pytest.approx(cosines(str(repo / "snapshots" / second), images), abs=1e-6)
        assert after != pytest.approx(before, abs=1e-3)
    finally:
        clear_cache()


def test_a_file_rewritten_with_its_old_size_and_time_has_another_stamp(tmp_path):
    """``cp -p`` or ``rsync -t`` keep a file's modification time: the stamp holds the change time too, which
    no copy can set back."""
    import os
    import time

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"1" * 64)
    before, alone = files_stamp(tmp_path), files_stamp(path)  # (an image file's key holds the file's stamp)
    st = path.stat()
    for _ in range(300):  # until the change time moves on (its granularity is the file system's)
        time.sleep(0.01)
        with open(path, "r+b") as f:  # in place: the same inode and size
            f.write(b"2" * 64)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        if path.stat().st_ctime_ns != st.st_ctime_ns:
            break
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ino == st.st_ino
    assert files_stamp(tmp_path) != before and files_stamp(path) != alone
