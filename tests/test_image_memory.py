"""Memory follows the batch, not the photos: decoded images are cached up to a byte budget and reduced, as
they are read, to what the metrics' processors need, without changing what the processor outputs beyond the
noise of re-saving the photo as a high-quality JPEG."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import capeval_plugins
from capeval_plugins import runner
from capeval_plugins.inputs import InputError, ImageSource, Samples, image_source
from capeval_plugins.testing.clip import clip_image_processor


def large_photo(width=4000, height=3000, seed=0) -> Image.Image:
    """Grace Hopper at 12 megapixels, with sensor-like noise so the fine detail a resize must filter is there."""
    from matplotlib import cbook

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        big = img.convert("RGB").resize((width, height), Image.LANCZOS)
    noise = np.random.default_rng(seed).integers(-20, 21, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(big).astype(int) + noise, 0, 255).astype(np.uint8))


def encoded(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photo_files():
    big = large_photo()
    return {"jpeg": encoded(big, "JPEG", quality=92), "png": encoded(big, "PNG", compress_level=1)}


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_shrinking_as_read_keeps_the_processor_output_within_jpeg_noise(photo_files, fmt):
    """CLIP's processor (shortest edge 224, centre crop 224) on the photo decoded at full size and on the photo
    reduced as it is read. The yardstick is an imperceptible change of the same photo: re-saving it as a JPEG
    at quality 95 (measured: up to 2 of 255 levels, 0.14-0.16 on average); the reduction must change the
    processor's output no more."""
    processor = clip_image_processor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    scale = np.asarray(processor.image_std)[:, None, None] * 255  # normalised units -> 8-bit levels

    def pixels(image):
        return processor(images=[image], return_tensors="np")["pixel_values"][0]

    source = image_source(photo_files[fmt], 0)
    full = source.load()
    reduced = source.load(keep_side=runner.KEEP_FACTOR * 224)
    assert full.size == (4000, 3000) and min(reduced.size) == runner.KEEP_FACTOR * 224
    resaved = Image.open(io.BytesIO(encoded(full, "JPEG", quality=95))).convert("RGB")
    shrink_error = np.abs(pixels(full) - pixels(reduced)) * scale
    jpeg_error = np.abs(pixels(full) - pixels(resaved)) * scale
    assert shrink_error.max() <= max(2.0, jpeg_error.max()) + 1e-3
    assert shrink_error.mean() <= 1.25 * jpeg_error.mean()


def test_scores_of_large_photos_with_and_without_early_shrinking(tiny_clip, monkeypatch):
    """Through the runner (tiny CLIP: processor side 32, so images keep 128): the shrink moves scores by
    less than re-saving the photos as JPEG at quality 95 does (each score is a smooth function of the pixels
    the processor outputs, and those move less; see the test above)."""
    photos = [large_photo(2400, 1800, seed) for seed in range(3)]
    resaved = [Image.open(io.BytesIO(encoded(p, "JPEG", quality=95))).convert("RGB") for p in photos]
    captions = ["a woman in a uniform", "a portrait of an officer", "a photo"]
    clip = capeval_plugins.load("clipscore", model=tiny_clip)
    shrunk = clip(photos, captions).scores.double()
    assert runner.pass_keep_side([clip]) == runner.KEEP_FACTOR * 32
    monkeypatch.setattr(runner, "pass_keep_side", lambda metrics: None)
    full = clip(photos, captions).scores.double()
    jpeg = clip(resaved, captions).scores.double()
    assert (shrunk - full).abs().mean() <= (jpeg - full).abs().mean() + 1e-6


def test_a_metric_that_needs_full_size_images_turns_shrinking_off(tiny_clip):
    class FullSize:
        info = capeval_plugins.load("clipscore", model=tiny_clip).info

        def image_side(self):
            return None

        def image_reader(self):
            return None

    clip = capeval_plugins.load("clipscore", model=tiny_clip)
    assert runner.pass_keep_side([clip]) == runner.KEEP_FACTOR * clip.image_side()
    assert runner.pass_keep_side([clip, FullSize()]) is None

    class ReadsFeatures(FullSize):  # takes ids of precomputed features, not pixels: no say in the pixel size
        def image_reader(self):
            return object()

    assert runner.pass_keep_side([clip, ReadsFeatures()]) == runner.KEEP_FACTOR * clip.image_side()


def counting_sources(n, size=(200, 100)):
    loads = []

    class Counted(ImageSource):
        def load(self, keep_side=None):
            loads.append(self.index)
            return super().load(keep_side)

    sources = [Counted("pil", Image.new("RGB", size, (i, 0, 0)), ("obj", i), i) for i in range(n)]
    return sources, loads


def test_the_cache_is_bounded_by_bytes():
    sources, loads = counting_sources(10)
    one = 200 * 100 * 3
    cache = runner.ImageCache(max_bytes=3 * one)
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
    batch, skipped = runner.build_batch(part, runner.ImageCache(max_bytes=0), "raise")
    assert not skipped and len(batch.images) == 4 and sorted(loads) == [0, 1, 2, 3]  # each decoded once
    assert [img.getpixel((0, 0))[0] for img in batch.images] == [0, 1, 2, 3]


def test_a_failed_decode_is_cached_and_reported_for_its_sample():
    bad = ImageSource("bytes", b"not an image", ("bytes", "x"), 7)
    cache = runner.ImageCache(max_bytes=0)
    with pytest.raises(InputError, match="sample 7: cannot read image"):
        cache.load(bad)
    assert isinstance(cache.items[bad.key], InputError)
