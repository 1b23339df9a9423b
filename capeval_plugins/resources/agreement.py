"""A processor or tokenizer against the model beside it, in what no weight holds (the third of a model folder's
checks, after :mod:`.wholeness`'s): an image processor must feed its vision tower, a CLIP tokenizer's end token
must be where the text is pooled, a vision-language processor must lay out the image tokens the model reads. Each
disagreement gave a traceback at the first batch, or other numbers with exit 0. :func:`check_against_model` runs
them when :func:`capeval_plugins.resources.loading.load_processor` loads a processor or tokenizer."""
from __future__ import annotations

from typing import Any

import torch

from capeval_plugins.resources.wholeness import ModelLoadError, finite, first_line


def check_against_model(loaded: Any, name_or_path: str, config: Any, tokenizer: Any) -> None:
    """Refuse ``loaded`` (a processor, or a tokenizer ``tokenizer``) that disagrees with the model whose
    configuration is ``config`` (None: none beside it), naming the folder."""
    image_processor = image_processor_of(loaded)
    checks = []
    if image_processor is not None:
        checks.append(("processor", lambda: image_processor_problem(image_processor, vision_tower(config))))
    if config is not None and tokenizer is not None:
        checks.append(("tokenizer", lambda: clip_pooling_problem(tokenizer, config)))
    if config is not None and image_processor is not None and tokenizer is not None:
        checks.append(("processor", lambda: processor_config_problem(loaded, config)))
    for what, check in checks:
        problem = check()
        if problem:
            raise ModelLoadError(f"cannot load the {what} of {name_or_path!r}: {problem}: the {what} and the model "
                                 "are not of one checkpoint")


# Vision towers whose position embeddings fix the input size: an image of any other size raises at the first
# batch (transformers' CLIP and SigLIP embeddings), so the processor must make exactly ``image_size``.
FIXED_SIZE_VISION = ("clip_vision_model", "siglip_vision_model")
PROBE_SIZE = (61, 37)  # width, height: not square, so a resize that keeps the aspect ratio shows


def image_processor_of(loaded: Any) -> Any:
    """The image processor of a processor (or the processor itself when it is one), else None."""
    image = getattr(loaded, "image_processor", None)
    if image is not None:
        return image
    tokenizer = callable(getattr(loaded, "convert_tokens_to_ids", None))
    return loaded if callable(getattr(loaded, "preprocess", None)) and not tokenizer else None


def vision_tower(config: Any) -> Any:
    """The vision tower's configuration inside a model's (``vision_config``), or the model's own when it is a
    vision model; None when it has none."""
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        return vision
    return config if getattr(config, "image_size", None) is not None else None


def image_processor_problem(image_processor: Any, vision: Any = None) -> str | None:
    """Why ``image_processor`` cannot feed the vision tower ``vision`` describes (None: not known), or None.

    It is run once on a small RGB image: a configuration it cannot apply (an ``image_mean`` of two values, an
    empty one) fails there rather than on the user's first batch, and its output must be finite (an
    ``image_std`` of 0 divides by zero), with the tower's channels and, for a tower of fixed size, its size. A
    configuration that only makes other numbers (another mean, no rescaling) is the model's own and passes."""
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():  # numpy's divide-by-zero warning, said below as one line
            warnings.simplefilter("ignore", RuntimeWarning)
            out = image_processor(images=[Image.new("RGB", PROBE_SIZE, (200, 120, 40))], return_tensors="pt")
        pixels = out.get("pixel_values") if hasattr(out, "get") else None
    except Exception as err:
        return f"its image processor fails on a {PROBE_SIZE[0]}x{PROBE_SIZE[1]} RGB image ({first_line(err)})"
    if not isinstance(pixels, torch.Tensor):
        return None  # another layout (video frames, patch lists): the model's own checks apply
    if pixels.is_floating_point() and not finite(pixels):
        return "its image processor makes non-finite pixel values (an image_std of 0?)"
    if vision is None or pixels.dim() not in (4, 5):
        return None
    channels, size = getattr(vision, "num_channels", None), getattr(vision, "image_size", None)
    if isinstance(channels, int) and pixels.shape[-3] != channels:
        return f"its image processor makes {pixels.shape[-3]}-channel images, but the vision tower takes {channels}"
    kind = getattr(vision, "model_type", None)
    if kind in FIXED_SIZE_VISION and isinstance(size, int) and tuple(pixels.shape[-2:]) != (size, size):
        return (f"its image processor makes {pixels.shape[-1]}x{pixels.shape[-2]} images, but the vision tower "
                f"({kind}) takes {size}x{size} only")
    return None


def clip_pooling_problem(tokenizer: Any, config: Any) -> str | None:
    """Why a CLIP text tower (``config``, a model's configuration) would pool its text features at another token
    than ``tokenizer``'s end token, or None. transformers' CLIP takes the features at the first position holding
    the configuration's ``eos_token_id``, or, when that is 2 (configurations written before transformers fixed
    it), at the largest id of the sequence: either must be the tokenizer's end token, else every text is read at
    its first token (or another word) and every score changes, silently."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if getattr(text, "model_type", None) != "clip_text_model":
        return None
    eos, end = getattr(text, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int) or not isinstance(end, int):
        return None
    if eos == 2:
        largest = max(tokenizer.get_vocab().values(), default=end)
        if end < largest:
            return (f"config.json's text eos_token_id is 2, so CLIP pools at the largest token id, but the tokenizer's "
                    f"end token {tokenizer.eos_token!r} is id {end}, not the largest ({largest})")
        return None
    if eos != end:
        return (f"config.json's text eos_token_id is {eos}, where CLIP pools the text, but the tokenizer's end token "
                f"{tokenizer.eos_token!r} is id {end}")
    return None


def processor_config_problem(processor: Any, config: Any) -> str | None:
    """Why a vision-language processor would lay out other image tokens than the model reads, or None: what both
    sides name must agree: the image token's id, the feature selection strategy (LLaVA: the tower's CLS kept or
    not), the tower's patch size, Qwen-VL's merge and temporal patch sizes. A disagreement failed at the first
    batch ("image features and image tokens do not match") or, for the token id, read no image at all."""
    token, model_id = getattr(processor, "image_token", None), getattr(config, "image_token_id", None)
    if isinstance(token, str) and isinstance(model_id, int):
        held = processor.tokenizer.convert_tokens_to_ids(token)
        if held != model_id:
            return (f"its image token {token!r} is id {held} in its tokenizer, but config.json's image_token_id is "
                    f"{model_id}")
    image, vision = getattr(processor, "image_processor", None), getattr(config, "vision_config", None)
    pairs = (("vision_feature_select_strategy", processor, "vision_feature_select_strategy", config),
             ("patch_size", processor, "patch_size", vision), ("patch_size", image, "patch_size", vision),
             ("merge_size", image, "spatial_merge_size", vision),
             ("temporal_patch_size", image, "temporal_patch_size", vision))
    for name, holder, model_name, model_holder in pairs:
        ours, theirs = getattr(holder, name, None), getattr(model_holder, model_name, None)
        if ours is not None and theirs is not None and isinstance(ours, (int, str)) and ours != theirs:
            where = "config.json" if model_holder is config else "config.json's vision_config"
            return f"its {name} is {ours!r}, but {where} says {model_name} = {theirs!r}"
    return None
