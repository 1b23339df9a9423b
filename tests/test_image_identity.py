"""An image is the same one only while it is: a cache that outlives one call (the torchmetrics adapter's, for the
metric's life) never serves another image's pixels. In-memory images were keyed by ``id()``, which CPython hands
to the next object once one is freed; a path by its name alone, however often the file was written again."""
from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

import capeval_plugins
from capeval_plugins.image_sources import image_source
from capeval_plugins.session.mapping import ImageCache
from tests.conftest import random_image

CAPTION = "a photo of something"


def _photos(n: int) -> list[np.ndarray]:
    return [np.asarray(random_image(seed, size=(64, 48))) for seed in range(n)]


def test_in_memory_images_fed_one_update_at_a_time_are_each_scored(tiny_clip):
    from PIL import Image

    from capeval_plugins.torchmetrics import CLIPScore

    photos = _photos(6)
    grey = lambda a: Image.fromarray(a).convert("L")  # noqa: E731  (decoded to a new RGB image, as arrays are)
    for form in (np.array, grey):
        direct = capeval_plugins.load("clipscore", model=tiny_clip)([form(p) for p in photos], [CAPTION] * 6)
        assert len(set(np.round(direct.scores.tolist(), 6))) == 6  # six different scores to tell them apart
        metric = CLIPScore(model=tiny_clip)
        for photo in photos:
            copy = form(photo.copy())  # freed after the update: its id() is free for the next copy
            metric.update([copy], [CAPTION])
            del copy
            gc.collect()
        assert metric.compute_all().scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)


def test_a_cached_image_keeps_its_object_so_no_other_takes_its_key():
    picture = random_image(0).convert("L")  # decoded to a new RGB image: the cache keeps that, not this
    alive = weakref.ref(picture)
    cache = ImageCache(0)
    cache.load(image_source(picture, 0))
    del picture
    gc.collect()
    assert alive() is not None  # held by the cache's key: its id() cannot be given to another image


def test_a_file_written_again_between_updates_is_read_again(tiny_clip, tmp_path):
    from capeval_plugins.torchmetrics import CLIPScore

    first, second = random_image(1, size=(64, 48)), random_image(2, size=(64, 48))
    originals = [tmp_path / "first.png", tmp_path / "second.png"]
    first.save(originals[0])
    second.save(originals[1])
    direct = capeval_plugins.load("clipscore", model=tiny_clip)([str(p) for p in originals], [CAPTION] * 2)
    reused = tmp_path / "sample.png"  # a loop that writes each step's image to one file
    metric = CLIPScore(model=tiny_clip)
    for k, picture in enumerate((first, second)):
        picture.save(reused)
        os.utime(reused, ns=(k * 10**9, k * 10**9))  # another modification time even where sizes agree
        metric.update([str(reused)], [CAPTION])
    assert metric.compute_all().scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)


def test_a_files_identity_across_processes_is_its_path_not_its_version(tmp_path):
    """Group ids (Soft-MSD under DDP) come from the identity: a copy of a dataset on each node has other inodes
    and times, and must give the same ids; the cache key, within one process, holds the version."""
    from capeval_plugins.image_sources import image_identity
    from capeval_plugins.inputs import image_group_ids

    path = tmp_path / "a.png"
    random_image(3).save(path)
    before = image_source(str(path), 0)
    os.utime(path, ns=(5 * 10**9, 5 * 10**9))
    after = image_source(str(path), 0)
    assert before.key != after.key
    assert image_identity(before.key, None) == image_identity(after.key, None)
    assert image_group_ids([before]) == image_group_ids([after])
