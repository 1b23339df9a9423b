"""Polos (Wada et al., CVPR 2024): a metric learned from human judgments (Polaris) on SimCSE-RoBERTa sentence
embeddings of the candidate and each reference and CLIP ViT-B/32 embeddings of the image and texts; the score is
the highest regressor output over the references (see :mod:`capeval_plugins.models.encoders.polos`).

The weights are the released checkpoint (``reprod.ckpt``) converted by ``capeval convert polos``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, ModelConfig, PointwiseMetric, Requirement
from capeval_plugins.resources import loading
from capeval_plugins.models.encoders import EncoderSpec
from capeval_plugins.models.encoders.openai_clip import OfficialClip, converted_model_dir
from capeval_plugins.core.messages import install_extra, warn_once
from capeval_plugins.resources.releases import RELEASES

if TYPE_CHECKING:  # the model imports transformers' model classes: only when one is loaded (``capeval list`` is fast)
    from capeval_plugins.models.encoders.polos import PolosModel

CITATION = """@inproceedings{wada2024polos,
  title     = {{Polos: Multimodal Metric Learning from Human Feedback for Image Captioning}},
  author    = {Wada, Yuiga and Kaneda, Kanta and Saito, Daichi and Sugiura, Komei},
  booktitle = {Proceedings of CVPR},
  year      = {2024}
}"""
RELEASE = RELEASES["polos"].url  # reprod.zip, as the keio-smilab24/Polos README links it


@dataclass
class PolosConfig(ModelConfig):
    batch_size: int = 32
    # "" = the folder `capeval convert polos` writes; or any converted Polos folder.
    model: str = ""


class Polos(PointwiseMetric):
    info = MetricInfo(
        name="polos",
        display_name="Polos",
        description=(
            "A learned metric (trained on Polaris human judgments): SimCSE-RoBERTa embeddings of the candidate and "
            "each reference and CLIP embeddings of the image and texts feed a regressor; the best reference's "
            "output in [0, 1]. Needs references and the released checkpoint."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=(0.0, 1.0),
        paper="https://arxiv.org/abs/2402.18091",
        paper_config={"checkpoint": "reprod.ckpt", "text encoder": "princeton-nlp/sup-simcse-roberta-base",
                      "clip": "ViT-B/32", "regressor": "6144-2304-1152-1, Tanh, sigmoid"},
        codebase_urls=("https://github.com/keio-smilab24/Polos",),
    )
    Config = PolosConfig
    extra_names: ClassVar[tuple[str, ...]] = ()

    def checkpoint(self) -> str:
        return self.config.model or str(converted_model_dir("polos"))

    def requirements(self) -> list[Requirement]:
        needs = super().requirements()
        if not self.config.model:
            needs.append(Requirement("model", self.checkpoint(), "the Polos weights",
                                     remedy=f"run `capeval fetch-weights polos` (downloads reprod.zip from {RELEASE}, "
                                            "checks and converts it), or unzip a copy and run `capeval convert polos "
                                            "reprod/reprod.ckpt`, or pass model=FOLDER"))
        needs.append(Requirement("module", "ftfy", "polos's CLIP text cleaning (as clip.tokenize)",
                                 install_extra("pacs")))
        return needs

    def spec(self, folder: str) -> EncoderSpec:
        return EncoderSpec.from_config(self.config, model=folder)

    @property
    def model(self) -> PolosModel:
        from capeval_plugins.models.encoders.polos import PolosModel

        return loading.load_spec(PolosModel, self.spec(self.checkpoint()))

    @property
    def clip(self) -> OfficialClip:
        return OfficialClip.shared(self.spec(str(Path(self.checkpoint()) / "clip")))

    @property
    def tokenizer(self):
        # RoBERTa's, named directly: AutoTokenizer would read the folder's config.json (a Polos one, unknown to
        # AutoConfig) and log a warning about model types on every load.
        from transformers import RobertaTokenizer

        cfg = self.config
        return loading.load_processor(RobertaTokenizer, self.checkpoint(), revision=cfg.revision,
                                      local_files_only=cfg.local_files_only)

    @torch.inference_mode()
    def sentence_embeddings(self, texts: list[str]) -> Tensor:
        model, tokenizer = self.model, self.tokenizer
        limit = model.text_encoder.config.max_position_embeddings - 2  # RoBERTa's positions start after padding
        tokens = tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
        if tokens["attention_mask"].sum(-1).max() >= limit and any(
                len(ids) > limit for ids in tokenizer(texts, truncation=False)["input_ids"]):
            warn_once(("truncate", self.checkpoint()), f"polos: caption(s) longer than {limit} tokens are truncated "
                      "(the official code fails on them); reported once")
        device = loading.input_device(model, self.config.device)
        return model.sentence_embeddings(tokens["input_ids"].to(device), tokens["attention_mask"].to(device))

    def score(self, batch: Batch) -> dict[str, Tensor]:
        from capeval_plugins.models.encoders.polos import flatten_references

        model, clip = self.model, self.clip
        prefix = model.config.prefix
        flat, owner = flatten_references(batch.references)
        # Every text of the batch through each encoder once; each image once for all of its candidates.
        sentences = self.sentence_embeddings(list(batch.candidates) + flat)
        with torch.inference_mode():
            clip_texts = clip.text_features([prefix + t for t in list(batch.candidates) + flat])
            image = clip.image_features(batch.images)[batch.image_index.to(clip.device)]
            n = len(batch.candidates)
            device = sentences.device
            scores = model.score(sentences[:n], sentences[n:], owner.to(device), image.to(device),
                                 clip_texts[:n].to(device), clip_texts[n:].to(device))
        return {"score": scores.double().cpu()}


METRICS = [Polos]
