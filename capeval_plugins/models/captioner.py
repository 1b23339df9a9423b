"""Captioners: what writes the captions that ``caption_and_score`` / ``capeval caption`` then score.

A captioner turns a batch of decoded RGB images into one caption each. Two kinds:

- :class:`HFCaptioner`: any Hugging Face image-to-text model (BLIP, GIT, Pix2Struct, VisionEncoderDecoder,
  an LVLM with a ``prompt``) by hub id or local path, loaded through the package's one loader (safetensors
  only, checked whole, ``trust_remote_code`` off unless asked), batched, greedy by default. A decoder-only
  model's answer starts with its prompt's tokens: they are cut; BLIP's text prefix stays, as BLIP writes its
  conditional captions ("a photography of ...");
- :class:`FunctionCaptioner`: any callable ``predict(images) -> captions``.

``identity()`` is what a resumed run checks it is the same captioner: a model by its files' content (a hub id
by its cached commit) and generation options; a function by its module and name only (its code is not hashed:
after changing it, start over with ``restart``).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from capeval_plugins.core.messages import DataError
from capeval_plugins.resources import loading

DEFAULT_MAX_NEW_TOKENS = 30  # BLIP's and GIT's captions are well under 30 tokens; an LVLM's long ones are not


class CaptionerError(DataError):
    """A captioner asked for what it cannot do (a prompt to a model that takes none, a bad option): one line."""


class Captioner:
    """One caption per image, in order (see the module docstring)."""

    name = "captioner"

    def identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def caption(self, images: Sequence[Any]) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """Free what captioning holds (a model's weights) before the metrics load theirs."""


class FunctionCaptioner(Captioner):
    def __init__(self, predict: Callable[[list], Any]) -> None:
        self.predict = predict
        self.name = getattr(predict, "__qualname__", None) or type(predict).__qualname__

    def identity(self) -> dict[str, Any]:
        module = getattr(self.predict, "__module__", None) or type(self.predict).__module__
        return {"function": f"{module}:{self.name}"}

    def caption(self, images: Sequence[Any]) -> Any:
        return self.predict(list(images))


class HFCaptioner(Captioner):
    """A Hugging Face image-to-text model and its processor (``AutoModelForImageTextToText``,
    ``AutoProcessor``; a VisionEncoderDecoder's ``AutoImageProcessor`` and tokenizer)."""

    def __init__(self, model: str, *, prompt: str | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 num_beams: int = 1, device: str | None = None, dtype: str | None = None,
                 revision: str | None = None, trust_remote_code: bool = False) -> None:
        if max_new_tokens < 1 or num_beams < 1:
            raise CaptionerError(f"max_new_tokens and num_beams must be 1 or more, got {max_new_tokens}, {num_beams}")
        self.model_name, self.prompt = model, prompt
        self.max_new_tokens, self.num_beams = int(max_new_tokens), int(num_beams)
        self.device, self.dtype, self.revision = device, dtype, revision
        self.trust_remote_code = trust_remote_code
        self.name = model
        self._loaded: tuple[Any, Any] | None = None

    def identity(self) -> dict[str, Any]:
        from capeval_plugins.digests import ContentDigests

        return {"model": ContentDigests().source(self.model_name, self.revision), "prompt": self.prompt,
                "max_new_tokens": self.max_new_tokens, "num_beams": self.num_beams, "dtype": self.dtype}

    def load(self) -> tuple[Any, Any, Any]:
        """The model, what prepares its inputs and what decodes its output, loaded once (a model not cached
        while offline: one-line ModelLoadError). A VisionEncoderDecoder folder has no joint processor: its
        image processor and tokenizer are loaded apart."""
        if self._loaded is None:
            from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor

            hub = {"revision": self.revision, "trust_remote_code": self.trust_remote_code}
            processor = loading.load_processor(AutoProcessor, self.model_name, **hub)
            decoder = processor
            if not hasattr(processor, "image_processor") and hasattr(processor, "batch_decode"):
                if self.prompt is not None:
                    raise CaptionerError(f"{self.model_name} takes images only (an image processor and a tokenizer): "
                                     "it takes no prompt")
                processor = loading.load_processor(AutoImageProcessor, self.model_name, **hub)
            # a copy of its own (share=False): released once the captions are written, before the metrics load
            model = loading.load_model(AutoModelForImageTextToText, self.model_name, device=self.device,
                                       dtype=self.dtype, share=False, **hub)
            self._loaded = (model, processor, decoder)
        return self._loaded

    def release(self) -> None:
        self._loaded = None

    @torch.inference_mode()
    def caption(self, images: Sequence[Any]) -> list[str]:
        model, processor, decoder = self.load()
        if self.prompt is None:
            inputs = processor(images=list(images), return_tensors="pt")
        else:
            inputs = processor(images=list(images), text=[self.prompt] * len(images), return_tensors="pt",
                               padding=True)
        device = loading.input_device(model, self.device)
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        out = model.generate(**inputs, max_new_tokens=self.max_new_tokens, num_beams=self.num_beams,
                             do_sample=False)
        prompt_ids = inputs.get("input_ids")
        if prompt_ids is not None and out.shape[1] >= prompt_ids.shape[1] and \
                torch.equal(out[:, :prompt_ids.shape[1]], prompt_ids):
            out = out[:, prompt_ids.shape[1]:]  # a decoder-only model repeats its prompt first
        return [text.strip() for text in decoder.batch_decode(out, skip_special_tokens=True)]


def as_captioner(predict: Any, **options: Any) -> Captioner:
    """A :class:`Captioner` from what the user gave: a captioner, a hub id or local path (``options``: those
    of :class:`HFCaptioner`), or a callable ``predict(images) -> captions``."""
    if isinstance(predict, Captioner):
        return predict
    if isinstance(predict, str):
        return HFCaptioner(predict, **options)
    if callable(predict):
        if options:
            raise CaptionerError(f"options {sorted(options)} apply to a Hugging Face model, not to a function")
        if inspect.isclass(predict):
            raise CaptionerError(f"predict is the class {predict.__name__}; give a function or an instance")
        return FunctionCaptioner(predict)
    raise CaptionerError(f"predict must be a Hugging Face model id or path, or a function images -> captions; got "
                    f"{type(predict).__name__}")
