"""Images in 16-bit, 32-bit integer and float modes, made from real photographs (scikit-image's astronaut and
camera, matplotlib's Grace Hopper): decoded by their mode's range, or refused by name, never clipped to white
or black and scored."""
from __future__ import annotations

import numpy as np
import torch
import pytest
from PIL import Image

from capeval_plugins.contract import MetricInfo
from capeval_plugins.inputs import InputError, image_source, prepare_samples, to_batch

INFO = MetricInfo(name="probe", display_name="Probe", references="never", images="always", description="", citation="")


def photo(name: str) -> np.ndarray:
    """An 8-bit grayscale photograph (H, W)."""
    if name == "grace_hopper":
        from matplotlib import cbook

        with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
            return np.asarray(img.convert("L"))
    data = pytest.importorskip("skimage.data")
    pixels = getattr(data, name)()
    return pixels if pixels.ndim == 2 else np.asarray(Image.fromarray(pixels).convert("L"))


PHOTOS = ["grace_hopper", "astronaut", "camera"]


def decoded(path) -> np.ndarray:
    """The RGB pixels the package scores for an image file."""
    samples = prepare_samples(INFO, [str(path)], ["a photo"])
    rgb = np.asarray(to_batch(samples).images[0])
    assert rgb.dtype == np.uint8 and rgb.shape[-1] == 3
    return rgb


def as_rgb(gray: np.ndarray) -> np.ndarray:
    return np.asarray(Image.fromarray(gray, "L").convert("RGB"))


@pytest.mark.parametrize("name", PHOTOS)
def test_a_16_bit_png_decodes_by_its_range(tmp_path, name):
    gray = photo(name)
    path = tmp_path / "photo16.png"
    Image.fromarray((gray.astype(np.uint16) * 257)).save(path)  # 255 -> 65535: the full 16-bit range
    with Image.open(path) as img:
        assert img.mode.startswith("I;16")
    # x * 257 / 257 is exact: the 8-bit photo comes back pixel for pixel (clipping made it near white)
    np.testing.assert_array_equal(decoded(path), as_rgb(gray))


@pytest.mark.parametrize("name", PHOTOS)
def test_16_bit_values_between_8_bit_steps_round_to_the_nearest(tmp_path, name):
    gray = photo(name)
    rng = np.random.default_rng(0)
    fine = np.clip(gray.astype(np.int64) * 257 + rng.integers(-128, 129, gray.shape), 0, 65535).astype(np.uint16)
    path = tmp_path / "photo16.png"
    Image.fromarray(fine).save(path)
    expected = np.round(fine / 65535.0 * 255.0).astype(np.uint8)  # independent: scale to [0, 1], then to 8 bits
    np.testing.assert_array_equal(decoded(path)[..., 0], expected)
    assert np.abs(decoded(path)[..., 0].astype(int) - gray).max() <= 1  # the noise is under half a step


@pytest.mark.parametrize("name", PHOTOS)
def test_a_float_tiff_in_0_1_decodes_by_its_range(tmp_path, name):
    gray = photo(name)
    path = tmp_path / "photo.tif"
    Image.fromarray((gray / 255.0).astype(np.float32), "F").save(path)
    with Image.open(path) as img:
        assert img.mode == "F"
    # float32 keeps x / 255 to 7 digits, far inside half an 8-bit step: rounding gives x back
    np.testing.assert_array_equal(decoded(path), as_rgb(gray))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_a_float_tensor_decodes_to_its_values_times_255_rounded_whatever_its_width(dtype):
    """A tensor in [0, 1] of any floating type the docs allow: x * 255 rounded, computed exactly (bfloat16, which
    numpy has no type for, failed at decoding; float16's own arithmetic was one step off on 4 % of pixels)."""
    rng = np.random.default_rng(0)
    values = torch.from_numpy(rng.random((3, 20, 24))).to(dtype)
    expected = np.round(values.double().permute(1, 2, 0).numpy() * 255.0)
    decoded = np.asarray(to_batch(prepare_samples(INFO, [values], ["a"])).images[0])
    np.testing.assert_array_equal(decoded, expected)


def test_a_float_tiff_outside_0_1_is_refused_with_its_range(tmp_path):
    gray = photo("grace_hopper")
    path = tmp_path / "photo.tif"
    Image.fromarray(gray.astype(np.float32), "F").save(path)  # 0..255 as float: convert("RGB") would clip
    samples = prepare_samples(INFO, [str(path)], ["a photo"])
    with pytest.raises(InputError, match=r"sample 0: cannot read image .*photo\.tif: float image \(mode F\) must lie "
                                         r"in \[0, 1\], got values in \[\d+, 255\]"):
        to_batch(samples)


@pytest.mark.parametrize("name", PHOTOS)
def test_a_32_bit_integer_image_is_refused_by_name_before_scoring(tmp_path, name):
    path = tmp_path / "photo32.tif"
    Image.fromarray(photo(name).astype(np.int32) * 65537).save(path)
    with Image.open(path) as img:
        assert img.mode == "I"
    with pytest.raises(InputError, match=r"sample 0: .*I images are not supported \(32-bit integer"):
        prepare_samples(INFO, [str(path)], ["a photo"])
    with pytest.raises(InputError, match="I images are not supported"):
        image_source(Image.open(path), 0)


def test_a_16_bit_photo_scores_as_its_8_bit_self(tiny_clip, tmp_path):
    import capeval_plugins

    gray = photo("grace_hopper")
    eight, sixteen = tmp_path / "eight.png", tmp_path / "sixteen.png"
    Image.fromarray(gray, "L").save(eight)
    Image.fromarray(gray.astype(np.uint16) * 257).save(sixteen)
    clip = capeval_plugins.load("clipscore", model=tiny_clip)
    scores = clip([str(eight), str(sixteen)], ["a woman in uniform", "a woman in uniform"]).scores
    assert float(scores[1]) == pytest.approx(float(scores[0]), abs=1e-6)  # same pixels, same float32 forward


def test_the_lm_eval_task_decodes_a_16_bit_image_by_its_range(tmp_path):
    from capeval_plugins.lm_eval_tasks.utils import doc_to_image

    gray = photo("grace_hopper")
    path = tmp_path / "sixteen.png"
    Image.fromarray(gray.astype(np.uint16) * 257).save(path)
    np.testing.assert_array_equal(np.asarray(doc_to_image({"image_path": str(path)})[0]), as_rgb(gray))
