"""The demo's photographs: written once, decodable, and never written over a file already in the folder."""
from __future__ import annotations

import json

import pytest
from conftest import EXAMPLES
from PIL import Image

pytest.importorskip("skimage")
from capeval_plugins.testing.realistic import PHOTOS, write_photos  # noqa: E402


def test_write_photos_gives_every_image_of_the_demo_and_keeps_existing_files(tmp_path):
    mine = tmp_path / "astronaut.jpg"
    mine.write_bytes(b"the user's own file")
    paths = write_photos(tmp_path)
    assert [p.name for p in paths] == [f"{name}.jpg" for name in PHOTOS]
    assert mine.read_bytes() == b"the user's own file"
    for path in paths[1:]:
        with Image.open(path) as image:
            assert image.mode == "RGB" and min(image.size) >= 300
    named = {json.loads(line)["image"] for line in (EXAMPLES / "photos.jsonl").read_text().splitlines()}
    assert named == {p.name for p in paths}
