"""Where the released checkpoints that ``capeval fetch-weights`` downloads live, and what they must be.

Each :class:`Release` names the official location (the URL its authors publish, or the file their published
folder holds), the file, the converter that turns it into the folder the metric loads, and its pinned size and
SHA-256. **No size or digest is pinned in this version**: none of these files could be downloaded where it was
written (no network but package registries), and no author publishes one. A release without a pinned digest is
refused unless the user gives the digest of a copy they trust (``--sha256``); a digest is never taken on trust
from the download itself. Pin ``size`` and ``sha256`` here once they are known from a trusted copy.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Release:
    """A released checkpoint: ``name`` (what ``capeval fetch-weights`` takes), the ``metrics`` that load it,
    the released ``file``, its official ``url`` and where that is ``published``, its pinned ``size`` and
    ``sha256`` (None: not known to this version), the ``converter`` (``capeval convert <converter>``) with its
    ``backbone``, and for an archive the ``member`` to convert (with the files beside it in the archive)."""

    name: str
    metrics: tuple[str, ...]
    file: str
    url: str
    published: str
    converter: str
    backbone: str | None = None
    member: str | None = None
    size: int | None = None
    sha256: str | None = None


_PACS = "the aimagelab/pacscore README"
_DRIVE = "https://drive.usercontent.google.com/download?id={}&export=download&confirm=t"
RELEASES: dict[str, Release] = {r.name: r for r in (
    Release("pacs-vit-b-32", ("pacscore", "refpacscore"), "clip_ViT-B-32.pth",
            _DRIVE.format("1F-0Pma-vfJPAiDzeyl-iEdSXZIO1cDae"),
            f"{_PACS} (its clip_ViT-B-32.pth link, in the authors' Google Drive folder "
            "15Da_nh7CYv8xfryIdETG6dPFSqcBiqpd)",
            "pacs", "vit-b-32"),
    # The README links this file to clip_ViT-B-32.pth's id (a slip); this id is the folder's openClip_ViT-L-14.pth
    # as CaptionEvalKit (capevalkit/infrastructure/assets/downloads.py) lists it.
    Release("pacs-open_clip-vit-l-14", ("pacscore", "refpacscore"), "openClip_ViT-L-14.pth",
            _DRIVE.format("1G1DAGQf5fW2U3u7K3Dn-eCC6koMDyvsU"),
            "the authors' Google Drive folder 15Da_nh7CYv8xfryIdETG6dPFSqcBiqpd linked from the aimagelab/pacscore "
            "README (file id as CaptionEvalKit lists it)", "pacs", "open_clip-vit-l-14"),
    Release("pacs_pp-vit-b-32", ("pacscore_pp", "refpacscore_pp"), "PAC++_clip_ViT-B-32.pth",
            "https://ailb-web.ing.unimore.it/publicfiles/pac++/PAC++_clip_ViT-B-32.pth", _PACS, "pacs", "vit-b-32"),
    Release("pacs_pp-vit-l-14", ("pacscore_pp", "refpacscore_pp"), "PAC++_clip_ViT-L-14.pth",
            "https://ailb-web.ing.unimore.it/publicfiles/pac++/PAC++_clip_ViT-L-14.pth", _PACS, "pacs", "vit-l-14"),
    Release("polos", ("polos",), "reprod.zip", "https://polos-polaris.s3.ap-northeast-1.amazonaws.com/reprod.zip",
            "the keio-smilab24/Polos README", "polos", member="reprod.ckpt"),
    # VELA (issue 53, item 1): its release goes here once its location is known, with converter "vela".
)}
# A metric's name for the release its default options load.
ALIASES = {"pacscore": "pacs-vit-b-32", "refpacscore": "pacs-vit-b-32", "pacscore_pp": "pacs_pp-vit-l-14",
           "refpacscore_pp": "pacs_pp-vit-l-14"}


def release(name: str) -> Release:
    """The release ``name`` (or a metric's alias); a ValueError naming the known ones otherwise."""
    found = RELEASES.get(ALIASES.get(name, name))
    if found is None:
        known = ", ".join([*RELEASES, *ALIASES])
        raise ValueError(f"no released checkpoint named {name!r}; known: {known}")
    return found


def for_metric(variant_backbone: str) -> Release | None:
    """The release of a converted folder name (``"pacs-vit-b-32"``, ``"polos"``), if there is one."""
    return RELEASES.get(variant_backbone)
