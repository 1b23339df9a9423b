"""CLIPScore and RefCLIPScore (Hessel et al., EMNLP 2021).

CLIP-S(c, v) = w * max(cos(E_img(v), E_txt(prefix + c)), 0), w = 2.5, prefix "A photo depicts ".
RefCLIP-S(c, R, v) = H-Mean(CLIP-S(c, v), max(max_{r in R} cos(E_txt(c), E_txt(r)), 0)).

``sentence_average=True`` scores a long caption as CaptionEvalKit's ``--sentence-average`` does: the mean of CLIP-S
over the candidate's sentences (:func:`capeval_plugins.core.clip_score.split_sentences`), each sentence prefixed and
scored on its own. The toolkit defines no reference-based average, so the Ref- metrics refuse the option and the
reference extras are left out (NaN) under it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, ModelConfig, PointwiseMetric, bounded
from capeval_plugins.resources import loading
from capeval_plugins.core.clip_score import (best_reference_similarity, clip_s, cosine, flatten_sentences,
                                             harmonic_mean, segment_mean)
from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec
from capeval_plugins.models.encoders.clip import dual_encoder_problem
from capeval_plugins.models.encoders.openai_clip import OfficialClip, check_preprocessing, fed

CITATION = """@inproceedings{hessel2021clipscore,
  title     = {{CLIPScore}: A Reference-free Evaluation Metric for Image Captioning},
  author    = {Hessel, Jack and Holtzman, Ari and Forbes, Maxwell and Le Bras, Ronan and Choi, Yejin},
  booktitle = {Proceedings of EMNLP},
  year      = {2021}
}"""


@dataclass
class CLIPScoreConfig(ModelConfig):
    model: str = "openai/clip-vit-base-patch32"
    w: float = bounded(2.5, gt=0)
    prefix: str = "A photo depicts"
    # The paper does not say whether references get the prefix; the official code prefixes every text.
    prefix_references: bool = True
    # The paper clamps the reference similarity at 0; the official code does not.
    clamp_reference: bool = True
    # CLIPScore is reference-free: references are encoded only for the RefCLIPScore extras, when asked for
    # (the refclipscore metric always computes them; it gives CLIPScore as an extra).
    reference_extras: bool = False
    # Faster numerics, off by default (they change the scores slightly; the card gives the measured effect):
    # "int8" quantizes the Linear layers' weights (dynamic int8 activations, CPU only); compile runs the
    # towers through torch.compile. dtype="bfloat16" (every ModelConfig) is the third.
    quantize: str = "none"
    compile: bool = False
    # Long captions: the mean score over the candidate's sentences (CaptionEvalKit's --sentence-average), not the
    # whole caption truncated at the text encoder's limit. Image-text score only (no reference-based average).
    sentence_average: bool = False
    # How images and texts become the model's inputs. "official": as the official code feeds OpenAI's CLIP
    # (clip.load's transform: a centre crop at round((extent - size) / 2), where transformers' processor floors it,
    # one pixel off at 640x427; clip.tokenize's ftfy fixes and HTML entities unescaped twice: "“red”", "&amp;" and
    # "ﬁ" are other tokens without them), for a checkpoint of CLIP's architecture; another architecture (SigLIP)
    # is fed by its own processor either way. "transformers": the checkpoint's processor and tokenizer as they
    # are (torchmetrics' CLIPScore).
    preprocessing: str = "official"

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE:
            raise ValueError(f"clipscore: quantize must be one of {QUANTIZE}, got {self.quantize!r}")
        check_preprocessing("clipscore", self.preprocessing)


QUANTIZE = ("none", "int8")


def with_prefix(prefix: str, text: str) -> str:
    # The official code adds a space after the prefix when it has none.
    if not prefix:
        return text
    return prefix + text if prefix.endswith(" ") else f"{prefix} {text}"


class CLIPScore(PointwiseMetric):
    info = MetricInfo(
        name="clipscore",
        display_name="CLIPScore",
        description=(
            "Reference-free image-caption compatibility: w * max(cos(CLIP image, CLIP text), 0) with the text "
            "prefixed by 'A photo depicts'. With references and reference_extras=True, RefCLIPScore comes as an "
            "extra."
        ),
        citation=CITATION,
        references="optional",
        images="always",
        score_range=(0.0, 2.5),
        paper="https://arxiv.org/abs/2104.08718",
        paper_config={"model": "openai/clip-vit-base-patch32", "w": 2.5, "prefix": "A photo depicts"},
        codebase_urls=("https://github.com/jmhessel/clipscore",),
    )
    Config = CLIPScoreConfig
    model_kind_problem = staticmethod(dual_encoder_problem)  # a --model shared by several metrics, checked unloaded
    extra_names: ClassVar[tuple[str, ...]] = ("cosine", "reference_similarity", "refclipscore")
    optional_extras: ClassVar[tuple[str, ...]] = ("reference_similarity", "refclipscore")
    mean_extras: ClassVar[tuple[str, ...]] = ("refclipscore",)

    def __init__(self, **config):
        super().__init__(**config)
        if self.config.sentence_average and self.info.references == "always":
            raise ValueError(f"{self.info.name}: sentence_average is defined for the image-text score only "
                             "(CaptionEvalKit's --sentence-average has no reference-based average); use "
                             f"{self.info.name.removeprefix('ref')} with sentence_average=True")

    @property
    def encoder(self) -> ClipEncoder | OfficialClip:
        cfg, spec = self.config, EncoderSpec.from_config(self.config)
        if cfg.quantize == "none" and not cfg.compile:
            return fed(spec, cfg.preprocessing)
        key = ("ClipEncoder", spec, cfg.quantize, cfg.compile)
        clip = loading.shared(key, lambda: faster(ClipEncoder(spec, share=False), cfg.quantize, cfg.compile))
        return fed(spec, cfg.preprocessing, clip, key)

    def uses_references(self) -> bool:
        # under sentence_average the reference extras are left out (NaN), so references are never read
        return self.info.references == "always" or (self.config.reference_extras and not self.config.sentence_average)

    def unused_references_hint(self) -> str:
        extra = self.optional_extras[-1]
        if self.config.sentence_average:
            return f" (sentence_average=True has no reference-based average; score with the {extra} metric)"
        return f" (reference_extras=True adds the {extra} extras; or score with the {extra} metric)"

    def preprocess_images(self, images) -> None:
        """The image processor on a batch's images ahead of time (capeval_plugins.prefetch; kept by content)."""
        self.encoder.preprocess(images)

    def score(self, batch: Batch) -> dict[str, Tensor]:
        if self.config.sentence_average:
            return self.sentence_average(batch)
        cfg, enc = self.config, self.encoder
        image_feats = enc.encode_images(batch.images)[batch.image_index.to(enc.device)]
        texts = [with_prefix(cfg.prefix, c) for c in batch.candidates]
        flat_refs, owner = [], []
        for i, refs in enumerate((batch.references or ()) if self.uses_references() else ()):
            flat_refs += [with_prefix(cfg.prefix, r) if cfg.prefix_references else r for r in refs]
            owner += [i] * len(refs)
        # The candidates alone through the text encoder, then the references: a candidate's features are then
        # the same bits whether references come along or not (chunks of similar length, float rounding), so
        # RefCLIPScore's clipscore and cosine are CLIPScore's own in a run of both
        cand = enc.encode_texts(texts)
        cos = cosine(image_feats, cand)
        score = clip_s(cos, cfg.w)
        ref_sim = torch.full_like(score, float("nan"))
        refclip = torch.full_like(score, float("nan"))
        if flat_refs:
            owner_t = torch.tensor(owner, device=cand.device)
            ref_sim = best_reference_similarity(cand, enc.encode_texts(flat_refs), owner_t, cfg.clamp_reference)
            refclip = self.combine(score, ref_sim)
        return self.arrange(score, cos, ref_sim, refclip)

    def sentence_average(self, batch: Batch) -> dict[str, Tensor]:
        """The mean score over each candidate's sentences (every sentence of the batch through the text encoder in
        one pass, each image once); ``cosine`` is the mean sentence cosine. References are not used."""
        cfg, enc = self.config, self.encoder
        sentences, owner = flatten_sentences(batch.candidates)
        owner = owner.to(enc.device)
        image_feats = enc.encode_images(batch.images)[batch.image_index.to(enc.device)]
        cos = cosine(image_feats[owner], enc.encode_texts([with_prefix(cfg.prefix, s) for s in sentences]))
        n = len(batch.candidates)
        score = segment_mean(clip_s(cos, cfg.w), owner, n)
        missing = torch.full_like(score, float("nan"))
        return self.arrange(score, segment_mean(cos, owner, n), missing, missing)

    def combine(self, score: Tensor, reference_similarity: Tensor) -> Tensor:
        """The reference-based score from the image-text score and the reference similarity."""
        return harmonic_mean(score, reference_similarity)

    def arrange(self, clip_s: Tensor, cosine: Tensor, ref_sim: Tensor, refclip: Tensor) -> dict[str, Tensor]:
        return {"score": clip_s, "cosine": cosine, "reference_similarity": ref_sim, "refclipscore": refclip}


def faster(encoder: ClipEncoder, quantize: str, compile: bool) -> ClipEncoder:
    """``encoder`` (with a model of its own, not the shared one) with int8 weights and / or compiled towers, both
    made in place: quantizing a copy kept the float32 weights alongside (1.71 GB peak for a ViT-B/32 run instead of
    1.06 GB)."""
    if quantize == "int8":
        if encoder.device.type != "cpu":
            raise ValueError("clipscore: quantize='int8' runs on the CPU only (dynamic int8 kernels)")
        encoder.model = torch.ao.quantization.quantize_dynamic(encoder.model, {torch.nn.Linear}, dtype=torch.qint8,
                                                               inplace=True)
    if compile:
        for tower in ("vision_model", "text_model"):
            if hasattr(encoder.model, tower):
                setattr(encoder.model, tower, torch.compile(getattr(encoder.model, tower)))
    return encoder


class RefCLIPScore(CLIPScore):
    info = MetricInfo(
        name="refclipscore",
        display_name="RefCLIPScore",
        description=(
            "Harmonic mean of CLIPScore and the (clamped) best cosine between the candidate and a reference "
            "in CLIP text space."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=(0.0, 2.5 * 1.0 * 2 / 3.5),
        paper="https://arxiv.org/abs/2104.08718",
        paper_config={"model": "openai/clip-vit-base-patch32", "w": 2.5, "prefix": "A photo depicts"},
        codebase_urls=("https://github.com/jmhessel/clipscore",),
    )
    extra_names: ClassVar[tuple[str, ...]] = ("clipscore", "cosine", "reference_similarity")
    optional_extras: ClassVar[tuple[str, ...]] = ()
    mean_extras: ClassVar[tuple[str, ...]] = ("clipscore",)

    def arrange(self, clip_s: Tensor, cosine: Tensor, ref_sim: Tensor, refclip: Tensor) -> dict[str, Tensor]:
        return {"score": refclip, "clipscore": clip_s, "cosine": cosine, "reference_similarity": ref_sim}


METRICS = [CLIPScore, RefCLIPScore]
