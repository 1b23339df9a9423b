"""The runner's prefetch (capeval_plugins/prefetch.py): the next batch's images decoded and preprocessed in a
background thread change no pixel and no number, hold at most one batch ahead, and fail where the batch would."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from PIL import Image

import capeval_plugins
from capeval_plugins import prefetch, runner
from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec
from capeval_plugins.testing.realistic import photo_crops


def files_of(tmp_path, count: int) -> list[str]:
    paths = []
    for k, image in enumerate(photo_crops(count, long_side=120)):
        path = tmp_path / f"p{k}.jpg"
        image.save(path, quality=90)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("preprocessing", ["official", "transformers"])
def test_prefetching_changes_no_score_and_runs_ahead(tmp_path, tiny_clip, monkeypatch, preprocessing):
    from capeval_plugins.models.encoders.openai_clip import OfficialClip

    paths = files_of(tmp_path, 6)
    captions = [f"a photo number {k} of something" for k in range(12)]
    images = [paths[k // 2] for k in range(12)]
    threads: list[str] = []
    feed = OfficialClip if preprocessing == "official" else ClipEncoder
    real = feed.pixel_values

    def spy(self, batch):
        threads.append(threading.current_thread().name)
        return real(self, batch)

    monkeypatch.setattr(feed, "pixel_values", spy)
    monkeypatch.setattr(feed, "preprocess", spy)
    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(prefetch.ENV, flag)
        options = {"model": tiny_clip, "batch_size": 4, "preprocessing": preprocessing}
        metrics = {"clipscore": capeval_plugins.load("clipscore", **options),
                   "refclipscore": capeval_plugins.load("refclipscore", **options)}
        metrics["clipscore"].encoder.pixels.clear()
        results[flag] = runner.score_many(metrics, images, captions, [[c] for c in captions[::-1]])
    for name in results["0"]:  # bit-equal: the same pixels reach the same model
        assert torch.equal(results["0"][name].scores, results["1"][name].scores)
    assert any(t.startswith("capeval-prefetch") for t in threads)  # the pixels were made ahead, in its thread


def test_prefetched_pixels_are_the_processors(tiny_clip):
    enc = ClipEncoder.shared(EncoderSpec(tiny_clip))
    batch = photo_crops(3, long_side=90)
    enc.pixels.clear()
    ahead = enc.preprocess(batch)
    direct = enc.processor.image_processor(images=batch, return_tensors="pt")["pixel_values"]
    assert torch.equal(ahead, direct) and enc.pixel_values([img.copy() for img in batch]) is ahead  # by content
    other = [Image.fromarray(np.asarray(batch[0])[:, ::-1].copy())] + batch[1:]
    assert not torch.equal(enc.pixel_values(other), ahead)  # other pixels: computed anew


class Source:
    def __init__(self, key, nbytes, fail=False):
        self.key, self.nbytes, self.fail, self.loads = key, nbytes, fail, 0

    def decoded_bytes(self):
        return self.nbytes

    def load(self):
        self.loads += 1
        if self.fail:
            raise ValueError(f"cannot decode {self.key}")
        return f"pixels of {self.key}"


def test_memory_is_bounded_and_failures_surface_where_the_batch_is_built(monkeypatch):
    monkeypatch.setenv(prefetch.ENV, "1")
    big = [Source("a", 100), Source("b", 100)]
    assert prefetch.prepare(big, [], max_bytes=150).images == {}  # over budget: decoded by its batch later
    assert all(s.loads == 0 for s in big)
    bad = Source("c", 10, fail=True)
    ready = prefetch.prepare([Source("a", 10), bad, Source("a", 10)], [], max_bytes=150)
    assert ready.load(Source("a", 10), None) == "pixels of a"
    with pytest.raises(ValueError, match="cannot decode c"):
        ready.load(bad, None)
    assert ready.load(Source("z", 1), lambda s: "decoded now") == "decoded now"
    seen = []
    prepared = prefetch.Prefetcher(lambda item: seen.append(item) or prefetch.Prefetched({item: item}))
    for n, (item, ready) in enumerate(prepared.iterate(range(5))):  # CAPEVAL_PREFETCH=1 (conftest) or auto
        assert ready.images == {item: item} and max(seen) <= item + 1  # never more than one item ahead


def test_by_default_it_prefetches_only_where_there_is_something_to_overlap(monkeypatch):
    monkeypatch.delenv(prefetch.ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert not prefetch.enabled()  # torch uses every core: the thread would only compete
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(prefetch.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert prefetch.enabled()
    monkeypatch.setenv(prefetch.ENV, "0")
    assert not prefetch.enabled()
