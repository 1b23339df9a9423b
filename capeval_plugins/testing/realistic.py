"""Realistic inputs for side-by-side checks against peer packages: real photographs and real captions.

Short synthetic strings and noise images miss what real data does to an implementation (captions of 10-20
words and a real vocabulary, some longer than CLIP's 77 tokens; photos of every size and aspect ratio,
several captions per image). These helpers give both without shipping any data:

* :func:`photos`: seven real photographs bundled with scikit-image and matplotlib (RGB, PIL);
* :func:`photo_crops`: ``count`` distinct images cut from those photos, one per image of a corpus;
* :func:`flickr8k_expert_pairs`: the distinct (image, candidate) pairs of Flickr8k-Expert's ``flickr8k.json``
  with their image's five references, read from a file the caller has (it is not part of the package).
"""
from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from capeval_plugins.core.messages import UnknownName

# scikit-image's sample photographs (bundled with the package, no download) and matplotlib's Grace Hopper.
SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "motorcycle_left", "camera")
PHOTOS = SKIMAGE_PHOTOS + ("grace_hopper",)


def missing_photo_packages() -> list[str]:
    """The packages that ship the photos (the ``photos`` extra) that are not installed."""
    return [pkg for pkg, module in (("scikit-image", "skimage"), ("matplotlib", "matplotlib"))
            if importlib.util.find_spec(module) is None]


def photo(name: str) -> Image.Image:
    """One of :data:`PHOTOS` as an RGB image. Needs scikit-image (or matplotlib for ``grace_hopper``)."""
    if name == "grace_hopper":
        from matplotlib import cbook

        with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
            return img.convert("RGB")
    if name not in SKIMAGE_PHOTOS:
        raise UnknownName(f"unknown photo {name!r}; available: {PHOTOS}")
    import skimage.data

    # scikit-image names the left view of its stereo pair "motorcycle_left" in its gallery only.
    pixels = skimage.data.stereo_motorcycle()[0] if name == "motorcycle_left" else getattr(skimage.data, name)()
    return Image.fromarray(pixels).convert("RGB")  # camera is grayscale


@functools.lru_cache(maxsize=1)
def photos() -> tuple[Image.Image, ...]:
    """All of :data:`PHOTOS`, in that order (decoded once per process)."""
    return tuple(photo(name) for name in PHOTOS)


def photo_crops(count: int, seed: int = 0, long_side: int = 500) -> list[Image.Image]:
    """``count`` distinct RGB images: image k is a window of 55-95 % of photo ``k % 7`` at a position drawn
    from ``seed``, resized so its longer side is ``long_side`` (Flickr8k's photos are 500 px on that side).
    Distinct images matter: cycling seven photos would give a corpus seven distinct images, which a metric
    that reuses image features, or fits a covariance to them (MID), would see through."""
    rng = np.random.default_rng(seed)
    sources = photos()
    out = []
    for k in range(count):
        src = sources[k % len(sources)]
        width, height = src.size
        w, h = (int(side * rng.uniform(0.55, 0.95)) for side in (width, height))
        left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
        scale = long_side / max(w, h)
        out.append(src.crop((left, top, left + w, top + h)).resize((round(w * scale), round(h * scale)),
                                                                   Image.BILINEAR))
    return out


@dataclass
class CaptionPairs:
    """Rows of a caption corpus: ``image[i]`` (0-based index of the row's image, in file order), its candidate
    caption and the image's references."""

    image: list[int]
    candidates: list[str]
    references: list[list[str]]

    @property
    def n_images(self) -> int:
        return max(self.image) + 1 if self.image else 0


def flickr8k_expert_pairs(path: str | Path, images: int | None = None) -> CaptionPairs:
    """The distinct (image, candidate) pairs of Flickr8k-Expert (``flickr8k.json`` in the CLIPScore / FLEUR
    format: 1,000 images, 5,664 pairs, each rated by three experts) of the first ``images`` images, in file
    order, captions exactly as in the file."""
    data = json.loads(Path(path).read_text())
    pairs = CaptionPairs([], [], [])
    for k, record in enumerate(list(data.values())[:images]):
        refs = list(record["ground_truth"])
        for caption in dict.fromkeys(j["caption"] for j in record["human_judgement"]):
            pairs.image.append(k)
            pairs.candidates.append(caption)
            pairs.references.append(refs)
    return pairs


def write_photos(folder: str | Path) -> list[Path]:
    """Write :data:`PHOTOS` into ``folder`` as ``<name>.jpg`` (JPEG quality 95), the images of
    ``examples/photos.jsonl`` (``make demo``). A file already there is kept, never overwritten (the folder may
    be the user's; a second ``make demo`` finds its photos in place). Returns the paths."""
    import io

    from capeval_plugins import files

    folder = Path(folder)
    paths = [folder / f"{name}.jpg" for name in PHOTOS]
    with files.Folder.open(folder, create=True)[0] as where:
        for path, name in zip(paths, PHOTOS):
            if where.kind(path.name) is None:
                buffer = io.BytesIO()
                photo(name).save(buffer, format="JPEG", quality=95)
                try:  # linked in, never renamed over: whatever appeared meanwhile (a file, a link) stays
                    where.write(path.name, buffer.getvalue(), replace=False)
                except FileExistsError:
                    pass
    return paths


if __name__ == "__main__":
    import argparse
    import sys

    from capeval_plugins.core.messages import install_extra

    parser = argparse.ArgumentParser(prog="python -m capeval_plugins.testing.realistic",
                                     description="Write the sample photographs (scikit-image's and matplotlib's, "
                                                 "the images of examples/photos.jsonl) into FOLDER as JPEG files; "
                                                 "files already there are kept.")
    parser.add_argument("folder", metavar="FOLDER", help="where to write them (made if missing)")
    folder = parser.parse_args().folder
    if missing_photo_packages():
        print(f"the sample photographs ship with {' and '.join(missing_photo_packages())}, not installed: "
              f"{install_extra('photos')}", file=sys.stderr)
        sys.exit(2)
    print(f"{len(write_photos(folder))} photographs in {folder} (files already there kept)")
