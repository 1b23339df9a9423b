"""Memory follows the batch, not the photos, and never by changing pixels: decoded images are cached up to a
byte budget for the other metrics of a pass, and a batch of large photos is mapped in pieces of whole images
(peak memory: benchmarks/image_memory.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import capeval_plugins
from capeval_plugins.session import mapping as session
from capeval_plugins.inputs import InputError, ImageSource, Samples, image_source


def test_a_batch_of_large_images_is_mapped_in_pieces_of_whole_images():
    """Pieces hold every sample once, all captions of an image together, and no more decoded pixels than the
    budget unless one image alone is larger."""
    sizes = [(400, 300), (300, 400), (1000, 1000), (200, 100), (400, 300)]
    sources = [ImageSource("pil", Image.new("RGB", size), ("obj", i), i) for i, size in enumerate(sizes)]
    owner = [0, 0, 1, 2, 2, 2, 3, 4, 1]  # image of each caption (image 1's captions not adjacent)
    part = Samples(candidates=[f"c{k}" for k in range(len(owner))], indices=list(range(len(owner))),
                   images=[sources[i] for i in owner])
    budget = 3 * 400 * 300 * 2  # two of the small images
    pieces = session.image_pieces(part, budget)
    assert sorted(i for piece in pieces for i in piece.indices) == list(range(len(owner)))
    for piece in pieces:
        keys = {s.key for s in piece.images}
        images_here = {owner[k] for k in piece.indices}
        assert all(sum(owner[k] == o for k in piece.indices) == owner.count(o) for o in images_here)  # whole
        held = sum(s.decoded_bytes() for s in {s.key: s for s in piece.images}.values())
        assert held <= budget or len(keys) == 1
    assert [sorted({owner[k] for k in p.indices}) for p in pieces] == [[0, 1], [2], [3, 4]]
    assert session.image_pieces(part, 10**9) == [part]


def test_scores_of_a_batch_mapped_in_pieces_equal_the_batch_at_once(tiny_clip, monkeypatch):
    """The pieces change where the batch is cut, never what a sample scores (to float32 rounding)."""
    rng = np.random.default_rng(0)
    photos = [Image.fromarray(rng.integers(0, 256, (300 + 20 * k, 260, 3), dtype=np.uint8)) for k in range(6)]
    captions = [f"a photo number {k}" for k in range(12)]
    images = [photos[k // 2] for k in range(12)]
    clip = capeval_plugins.load("clipscore", model=tiny_clip)
    whole = clip(images, captions)
    calls = []
    real = session._map_piece

    def counted(metric, part, *args, **kwargs):
        calls.append(len(part))
        return real(metric, part, *args, **kwargs)

    monkeypatch.setattr(session, "_map_piece", counted)
    monkeypatch.setattr(session, "BATCH_IMAGE_BYTES", 3 * 300 * 340)  # one or two photos per piece
    pieces = clip(images, captions)
    assert len(calls) > 1 and sum(calls) == 12
    assert torch.equal(pieces.indices, whole.indices)
    assert pieces.scores.tolist() == pytest.approx(whole.scores.tolist(), abs=1e-6)


def test_the_cache_keeps_images_for_the_other_metrics_of_a_pass_only(tiny_clip):
    clip = capeval_plugins.load("clipscore", model=tiny_clip)
    mid = capeval_plugins.load("mid", model=tiny_clip)
    bleu = capeval_plugins.load("bleu4")
    assert session.image_cache([clip]).max_bytes == 0
    assert session.image_cache([clip, bleu]).max_bytes == 0  # BLEU reads no pixels
    assert session.image_cache([clip, mid]).max_bytes == session.IMAGE_CACHE_BYTES


def test_decoded_size_is_read_from_the_header(tmp_path):
    img = Image.new("RGB", (123, 45))
    path = tmp_path / "x.png"
    img.save(path)
    data = path.read_bytes()
    for given in (str(path), data, img, np.zeros((45, 123, 3), np.uint8), torch.zeros(3, 45, 123, dtype=torch.uint8),
                  np.zeros((45, 123), np.uint8)):
        assert image_source(given, 0).decoded_bytes() == 3 * 123 * 45
    assert image_source([img, img], 0, video_ok=True).decoded_bytes() == 2 * 3 * 123 * 45


def counting_sources(n, size=(200, 100)):
    loads = []

    class Counted(ImageSource):
        def load(self):
            loads.append(self.index)
            return super().load()

    sources = [Counted("pil", Image.new("RGB", size, (i, 0, 0)), ("obj", i), i) for i in range(n)]
    return sources, loads


def test_the_cache_is_bounded_by_bytes():
    sources, loads = counting_sources(10)
    one = 200 * 100 * 3
    cache = session.ImageCache(max_bytes=3 * one)
    for source in sources:
        cache.load(source)
        assert cache.bytes <= 3 * one
    assert len(cache.items) == 3 and cache.bytes == 3 * one
    cache.load(sources[9])  # still cached: not decoded again
    assert loads.count(9) == 1
    cache.load(sources[0])  # evicted long ago: decoded again
    assert loads.count(0) == 2


def test_a_batch_keeps_its_images_when_the_cache_holds_none():
    sources, loads = counting_sources(4)
    part = Samples(candidates=[f"c{i}" for i in range(8)], indices=list(range(8)),
                   images=[sources[i // 2] for i in range(8)])
    batch, skipped = session.build_batch(part, session.ImageCache(max_bytes=0), "raise")
    assert not skipped and len(batch.images) == 4 and sorted(loads) == [0, 1, 2, 3]  # each decoded once
    assert [img.getpixel((0, 0))[0] for img in batch.images] == [0, 1, 2, 3]


def test_a_failed_decode_is_cached_and_reported_for_its_sample():
    bad = ImageSource("bytes", b"not an image", ("bytes", "x"), 7)
    cache = session.ImageCache(max_bytes=0)
    with pytest.raises(InputError, match="sample 7: cannot read image"):
        cache.load(bad)
    assert isinstance(cache.items[bad.key], InputError)
