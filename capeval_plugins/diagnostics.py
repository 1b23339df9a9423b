"""Drawing per-patch diagnostics over the image (MSD-Score's KL heatmaps), with PIL and numpy only.

    result = capeval_plugins.load("msd_score", diagnostics=True)(images, captions)
    render_patch_map(images[0], result.extras["patch_contributions"][0], path="coverage.png")

A patch map is one value per patch of the vision encoder's grid, in row-major order. CLIP's processor
resizes the shorter side and crops the centre square, so the grid covers that square (``crop="center"``, the
default); SigLIP's processor resizes the whole image to a square, so its grid covers the whole image
(``crop="full"``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

# Diverging colours (blue - white - red) for signed maps, centred on 0.
_DIVERGING = np.array([[59, 76, 192], [141, 176, 254], [221, 221, 221], [244, 154, 123], [180, 4, 38]], float)
# Sequential colours (dark - yellow) for maps of one sign.
_SEQUENTIAL = np.array([[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], float)


def patch_grid(values: Any, grid: tuple[int, int] | None = None) -> np.ndarray:
    """The patch values as a (rows, cols) float array; a square grid unless ``grid`` is given."""
    flat = np.asarray(values.tolist() if hasattr(values, "tolist") else values, dtype=float).reshape(-1)
    if grid is None:
        side = math.isqrt(len(flat))
        if side * side != len(flat):
            raise ValueError(f"{len(flat)} patch values do not form a square grid; pass grid=(rows, cols)")
        grid = (side, side)
    if grid[0] * grid[1] != len(flat):
        raise ValueError(f"grid {grid} does not hold {len(flat)} patch values")
    return flat.reshape(grid)


def colorize(grid: np.ndarray, signed: bool | None = None) -> np.ndarray:
    """RGBA uint8 colours for a grid: diverging around 0 when the values have both signs (or ``signed``),
    else sequential from the minimum to the maximum. NaN cells are transparent."""
    finite = np.isfinite(grid)
    values = np.where(finite, grid, 0.0)
    if signed is None:
        signed = bool(finite.any() and values[finite].min() < 0 < values[finite].max())
    if signed:
        scale = np.abs(values[finite]).max() if finite.any() else 0.0
        position = 0.5 + 0.5 * values / scale if scale > 0 else np.full_like(values, 0.5)
        palette = _DIVERGING
    else:
        low, high = (values[finite].min(), values[finite].max()) if finite.any() else (0.0, 0.0)
        position = (values - low) / (high - low) if high > low else np.full_like(values, 0.5)
        palette = _SEQUENTIAL
    anchors = np.linspace(0.0, 1.0, len(palette))
    rgb = np.stack([np.interp(position, anchors, palette[:, c]) for c in range(3)], axis=-1)
    alpha = np.where(finite, 255.0, 0.0)[..., None]
    return np.concatenate([rgb, alpha], axis=-1).round().astype(np.uint8)


def _open(image: Any) -> Image.Image:
    from capeval_plugins.inputs import image_source

    return image_source(image, 0).load()


def _cropped(image: Image.Image, crop: str) -> Image.Image:
    if crop == "full":
        return image
    if crop != "center":
        raise ValueError(f"crop must be 'center' or 'full', got {crop!r}")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    return image.crop((left, top, left + side, top + side))


def render_patch_map(
    image: Any,
    values: Sequence[float] | Any,
    *,
    path: str | Path | None = None,
    grid: tuple[int, int] | None = None,
    crop: str = "center",
    alpha: float = 0.55,
    signed: bool | None = None,
    min_size: int = 224,
) -> Image.Image:
    """Overlay a per-patch map on the image region the encoder saw; return it (RGB) and write a PNG to
    ``path`` if given. ``image`` is anything the metrics accept (PIL image, path, array, tensor, bytes);
    ``values`` one number per patch (NaN cells are left uncoloured). Small images are enlarged to at least
    ``min_size`` pixels on the shorter side so the grid stays visible."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    base = _cropped(_open(image), crop)
    if min(base.size) < min_size:
        factor = min_size / min(base.size)
        base = base.resize((round(base.width * factor), round(base.height * factor)), Image.BICUBIC)
    overlay = Image.fromarray(colorize(patch_grid(values, grid), signed))
    overlay = overlay.resize(base.size, Image.NEAREST)
    layer = np.asarray(overlay, dtype=float)
    weight = alpha * layer[..., 3:4] / 255.0
    blended = (1 - weight) * np.asarray(base, dtype=float) + weight * layer[..., :3]
    out = Image.fromarray(blended.round().clip(0, 255).astype(np.uint8))
    if path is not None:
        from capeval_plugins import files

        files.write_output(path, lambda f: out.save(f, format="PNG"), what="path")
    return out
