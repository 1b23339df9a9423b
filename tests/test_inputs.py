"""One place validates every input; errors name the sample."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from capeval_plugins.contract import MetricInfo
from capeval_plugins.inputs import InputError, group_by_image, image_batches, iter_batches, prepare_samples

IMG = MetricInfo(name="img", display_name="Img", description="", citation="", references="optional", images="always")
VIDEO = MetricInfo(name="vid", display_name="Vid", description="", citation="", images="always", video=True)
REFS = MetricInfo(name="refs", display_name="Refs", description="", citation="", references="always", images="never")


def pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB"))


@pytest.fixture
def base() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(10, 12, 3), dtype=np.uint8)


def load_one(image, info=IMG):
    samples = prepare_samples(info, [image], ["a caption"])
    return next(iter_batches(samples, 8)).images[0]


def test_every_image_form_decodes_to_the_same_pixels(base, tmp_path):
    pil = Image.fromarray(base)
    path = tmp_path / "x.png"
    pil.save(path)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    forms = [
        pil,
        str(path),
        path,
        {"bytes": buf.getvalue(), "path": None},
        {"path": str(path), "bytes": None},
        buf.getvalue(),
        base,                                             # numpy HWC uint8
        np.moveaxis(base, -1, 0),                         # numpy CHW uint8
        torch.from_numpy(np.moveaxis(base, -1, 0).copy()),  # torch CHW uint8
        torch.from_numpy(base.copy()),                    # torch HWC uint8
        torch.from_numpy(np.moveaxis(base, -1, 0) / 255.0),  # torch CHW float64 in [0, 1]
        (base / 255.0).astype(np.float32),                # numpy HWC float32
    ]
    for form in forms:
        assert np.array_equal(pixels(load_one(form)), base), type(form)


def test_grayscale_and_rgba(base):
    gray = base[..., 0]
    assert np.array_equal(pixels(load_one(gray))[..., 1], gray)
    rgba = np.concatenate([base, np.full(base.shape[:2] + (1,), 255, np.uint8)], axis=-1)
    assert np.array_equal(pixels(load_one(rgba)), base)


@pytest.mark.parametrize(
    "images, captions, refs, match",
    [
        ([None], ["ok"], None, "sample 0: image missing"),
        (["/no/such/file.png"], ["ok"], None, "sample 0: image file not found"),
        ([np.zeros((4, 4, 3))] * 2, ["ok", None], None, "sample 1: caption missing"),
        ([np.zeros((4, 4, 3))] * 2, ["ok", "a\x00b"], None, "sample 1: caption contains a NUL"),
        ([np.zeros((4, 4, 3))] * 2, ["ok", 3], None, "sample 1: caption must be a string"),
        ([np.zeros((4, 4, 3))], "a single string", None, "single string"),
        ([np.zeros((4, 4, 3))] * 3, ["a", "b"], None, "got 3 images for 2 captions"),
        ([np.full((4, 4, 3), 2.0)], ["ok"], None, r"sample 0: float images must lie in \[0, 1\]"),
        ([np.full((4, 4, 3), np.nan)], ["ok"], None, "sample 0: image array contains NaN or infinite"),
        ([torch.full((3, 4, 4), float("inf"))], ["ok"], None, "NaN or infinite"),
        ([np.zeros((0, 4, 3), np.uint8)], ["ok"], None, "image array is empty"),
        ([np.zeros((4, 4, 3), dtype=np.int32)], ["ok"], None, "dtype"),
        ([np.zeros((5, 6, 7))], ["ok"], None, "channel axis"),
        ([np.zeros((2, 4, 4, 3))], ["ok"], None, "HW, CHW or HWC"),
        ([12], ["ok"], None, "unsupported image type int"),
        ([np.zeros((4, 4, 3))] * 2, ["a", "b"], [["r"]], "references for 1 samples but 2 captions"),
        ([np.zeros((4, 4, 3))] * 2, ["a", "b"], [["r"], []], "sample 1: empty list of references"),
        ([np.zeros((4, 4, 3))] * 2, ["a", "b"], [["r"], ["ok", " "]], "sample 1: reference 1 is empty"),
        ([np.zeros((4, 4, 3))] * 2, ["a", "b"], [["r"], None], "sample 1: references missing"),
        ([[np.zeros((4, 4, 3))]], ["ok"], None, "list of frames"),
        # a mapping or a set has no sample order; list() of a dict gives its keys, silently misaligned
        ([np.zeros((4, 4, 3))], {"img1": "a dog"}, None, "candidates must be a sequence in sample order.*dict"),
        ([np.zeros((4, 4, 3))] * 2, {"a", "b"}, None, "candidates must be a sequence in sample order.*set"),
        ([np.zeros((4, 4, 3))], ["a"], {"img1": ["r"]}, "references must be a sequence in sample order.*dict"),
        ({"img1": np.zeros((4, 4, 3))}, ["a"], None, "images must be a sequence in sample order.*dict"),
    ],
)
def test_errors_name_the_sample(images, captions, refs, match):
    with pytest.raises(InputError, match=match):
        prepare_samples(IMG, images, captions, refs)


def test_missing_images_and_references():
    with pytest.raises(InputError, match="needs an image"):
        prepare_samples(IMG, None, ["a"])
    with pytest.raises(InputError, match="needs references"):
        prepare_samples(REFS, None, ["a"])
    with pytest.warns(UserWarning, match="does not use references"):
        assert prepare_samples(MetricInfo(name="free", display_name="F", description="", citation="",
                                          references="never", images="never"), None, ["a"], [["r"]]).references is None


def test_single_string_reference_is_one_reference():
    samples = prepare_samples(REFS, None, ["a", "b"], ["r1", ["r2", "r3"]])
    assert samples.references == [["r1"], ["r2", "r3"]]


def test_a_file_whose_header_does_not_decode_is_caught_by_validation(tmp_path):
    good = tmp_path / "good.png"
    Image.new("RGB", (4, 4)).save(good)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(InputError, match="sample 1: cannot read image .*bad.png"):
        prepare_samples(IMG, [good, bad], ["a", "b"])


def test_a_file_corrupt_past_its_header_is_reported_at_decode_with_its_index(tmp_path):
    good = tmp_path / "good.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(good)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:200])  # the header decodes, the pixels do not
    samples = prepare_samples(IMG, [good, truncated], ["a", "b"], indices=[10, 11])
    with pytest.raises(InputError, match="sample 11: cannot read image .*truncated.png"):
        list(iter_batches(samples, 8))


def test_every_problem_is_reported_together_by_the_samples_own_id(tmp_path):
    images = [np.zeros((4, 4, 3), np.uint8)] * 30
    captions = ["ok"] * 30
    for i in range(3, 30):
        captions[i] = None
    images[1] = str(tmp_path / "missing.png")
    with pytest.raises(InputError) as err:
        prepare_samples(IMG, images, captions, indices=[100 + i for i in range(30)])
    text = str(err.value)
    assert text.startswith("28 samples cannot be scored")
    assert "sample 101: image file not found" in text and "sample 103: caption missing" in text
    assert "sample 121: caption missing" in text and "sample 122:" not in text and "... and 8 more samples" in text  # the first 20 only
    assert len(err.value.problems) == 28 and err.value.problems[129] == "caption missing"


def test_validation_keeps_the_valid_samples_and_names_the_others():
    from capeval_plugins.inputs import validate_samples

    samples, problems = validate_samples(REFS, None, ["a", None, "c", 5], [["r"], ["r"], [], ["r"]], indices=[7, 8, 9, 10])
    assert samples.indices == [7] and samples.candidates == ["a"]
    assert problems.reasons() == {8: "caption missing", 9: "empty list of references",
                                  10: "caption must be a string, got int"}


def test_video_frames_and_dedupe():
    frames = [np.zeros((4, 4, 3), np.uint8), np.ones((4, 4, 3), np.uint8)]
    samples = prepare_samples(VIDEO, [frames, frames], ["a", "b"])
    batch = next(iter_batches(samples, 8))
    assert len(batch.images) == 1 and len(batch.images[0]) == 2
    with pytest.raises(InputError, match="video has no frames"):
        prepare_samples(VIDEO, [[]], ["a"])


def test_batches_keep_an_images_candidates_together_and_encode_it_once():
    a, b = Image.new("RGB", (4, 4)), Image.new("RGB", (4, 4), "red")
    images = [a, b, a, b, a, a]
    samples = prepare_samples(IMG, images, [f"c{i}" for i in range(6)])
    batches = list(iter_batches(samples, 4))
    first = batches[0]
    assert first.indices.tolist() == [0, 2, 4, 5]  # every caption of `a` first
    assert len(first.images) == 1 and first.image_index.tolist() == [0, 0, 0, 0]
    assert batches[1].indices.tolist() == [1, 3]
    assert sorted(i for b in batches for i in b.indices.tolist()) == list(range(6))


def _random_corpus(seed: int, n_images: int = 12, most: int = 9):
    rng = np.random.default_rng(seed)
    distinct = [np.full((2, 2, 3), k, dtype=np.uint8) for k in range(n_images)]
    owner = np.repeat(np.arange(n_images), rng.integers(1, most + 1, n_images))
    rng.shuffle(owner)
    return prepare_samples(IMG, [distinct[k] for k in owner], [f"c{i}" for i in range(len(owner))])


@pytest.mark.parametrize("seed,batch_size", [(0, 1), (1, 4), (2, 6), (3, 7), (4, 16), (5, 200)])
def test_batches_end_at_image_boundaries_where_the_next_image_does_not_fit(seed, batch_size):
    samples = _random_corpus(seed)
    plan = image_batches(samples, batch_size)
    image_of = [src.key for src in samples.images]
    assert [p for part in plan for p in part] == group_by_image(samples)  # same order, nothing lost
    assert all(0 < len(part) <= batch_size for part in plan)
    spans: dict = {}
    for k, part in enumerate(plan):
        for p in part:
            spans.setdefault(image_of[p], set()).add(k)
    counts = {key: image_of.count(key) for key in spans}
    for key, batches in spans.items():  # an image split only as much as its size forces
        assert len(batches) == -(-counts[key] // batch_size) if counts[key] > batch_size else len(batches) == 1
    for part, after in zip(plan, plan[1:]):  # a batch ends early only when the next image's captions do not fit
        head = image_of[after[0]]
        if image_of[part[-1]] != head:
            assert len(part) + sum(image_of[p] == head for p in after) > batch_size
        else:  # cut inside an image larger than a batch: a full one
            assert len(part) == batch_size


def test_text_batches_are_consecutive_slices():
    samples = prepare_samples(REFS, None, [f"c{i}" for i in range(10)], [["r"]] * 10)
    assert image_batches(samples, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(InputError, match="batch_size must be at least 1"):
        image_batches(samples, 0)


def test_group_ids_named_and_checked():
    from capeval_plugins.inputs import is_name_group

    named = prepare_samples(IMG, [np.zeros((2, 2))] * 3, ["a", "b", "c"], group_ids=["x", "y", "x"])
    assert named.group_ids[0] == named.group_ids[2] != named.group_ids[1]
    assert all(is_name_group(g) for g in named.group_ids)
    again = prepare_samples(IMG, [np.zeros((2, 2))], ["d"], group_ids=["y"])  # another call: the same group
    assert again.group_ids == named.group_ids[1:2]
    kept = prepare_samples(IMG, [np.zeros((2, 2))] * 3, ["a", "b", "c"], group_ids=[5, 5, -7])
    assert kept.group_ids == [5, 5, -1]  # (IMG is no group metric: None would be no group, -1, too)
    with pytest.raises(InputError, match="group ids"):
        prepare_samples(IMG, [np.zeros((2, 2))] * 2, ["a", "b"], group_ids=[1])


class TableReader:
    """A metric-specific reader: images are keys of a table (e.g. ids of precomputed features)."""

    def __init__(self, table):
        self.table = table

    def source(self, image, index):
        from capeval_plugins.inputs import ImageSource

        if image not in self.table:
            raise InputError(f"sample {index}: no entry for {image!r}")
        return ImageSource("table", image, ("table", image), index, reader=self)

    def load(self, source):
        return self.table[source.value]


def test_a_metric_reader_replaces_pixel_validation_and_loading():
    reader = TableReader({"a": torch.zeros(2), "b": torch.ones(3)})
    samples = prepare_samples(IMG, ["b", "a", "b"], ["x", "y", "z"], reader=reader)
    batch = next(iter_batches(samples, 8))
    assert [len(img) for img in batch.images] == [3, 2]  # each distinct key loaded once
    assert batch.image_index.tolist() == [0, 0, 1]  # candidates of one image grouped: samples 0, 2, then 1
    with pytest.raises(InputError, match="sample 1: no entry for 'c'"):
        prepare_samples(IMG, ["a", "c"], ["x", "y"], reader=reader)


def test_an_empty_or_blank_caption_is_an_answer_not_a_problem():
    """The model said nothing: that is scored (DESIGN.md), never dropped; text no tokenizer takes still is not."""
    from capeval_plugins.inputs import validate_samples

    captions = ["", "   ", "\t\n", "a dog", "\u3000"]
    samples, problems = validate_samples(REFS, None, captions, [["r"]] * 5)
    assert not problems and samples.candidates == captions and samples.indices == [0, 1, 2, 3, 4]


def test_a_bad_image_reads_the_same_message_in_every_process(tmp_path):
    """PIL names the file object it read (``<_io.BufferedReader name=3>``, a descriptor number), so one bad image
    wrote another ``error`` text in each process or rank of a run."""
    from PIL import UnidentifiedImageError

    from capeval_plugins.image_sources import pil_reason

    assert pil_reason(UnidentifiedImageError("cannot identify image file <_io.BufferedReader name=3>")) == \
        pil_reason(UnidentifiedImageError("cannot identify image file <_io.BufferedReader name=10>")) == \
        "cannot identify image file"
    from capeval_plugins.image_sources import ImageSource

    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")

    with pytest.raises(Exception, match=r"cannot read image .*bad\.jpg: cannot identify image file$"):
        ImageSource("path", str(bad), str(bad), 0).load()
