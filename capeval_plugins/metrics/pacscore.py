"""PAC-S and RefPAC-S (Sarto et al., CVPR 2023), PAC-S++ and RefPAC-S++ (Sarto et al., IJCV 2025).

CLIPScore's formula on a CLIP fine-tuned with positive-augmented contrastive learning, as the official
``evaluation/pac_score/pac_score.py`` and ``compute_metrics.py`` (aimagelab/pacscore) compute it:

    PAC-S(c, v)        = w * max(cos(E_img(v), E_txt("A photo depicts " + c)), 0),   w = 2
    RefPAC-S(c, R, v)  = 2 p s / (p + s),  p = PAC-S(c, v),  s = max_{r in R} cos(E_txt(pfx + c), E_txt(pfx + r))

(the reference similarity is not clipped at 0 there, unlike RefCLIP-S's paper definition). Images and texts are
fed as the official ``clip`` / ``open_clip`` code feeds them (:mod:`capeval_plugins.models.encoders.openai_clip`);
the weights are the released checkpoints converted by ``capeval convert pacs``. PAC-S++ is the same formula on
its LoRA-tuned CLIP.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import MetricInfo, Requirement, bounded
from capeval_plugins.models.encoders import EncoderSpec
from capeval_plugins.models.encoders.openai_clip import OfficialClip, converted_model_dir
from capeval_plugins.core.messages import install_extra
from capeval_plugins.metrics.clipscore import CLIPScore, CLIPScoreConfig

CITATION = """@inproceedings{sarto2023positive,
  title     = {{Positive-Augmented Contrastive Learning for Image and Video Captioning Evaluation}},
  author    = {Sarto, Sara and Barraco, Manuele and Cornia, Marcella and Baraldi, Lorenzo and Cucchiara, Rita},
  booktitle = {Proceedings of CVPR},
  year      = {2023}
}"""
CITATION_PP = """@article{sarto2025positive,
  title   = {{Positive-Augmented Contrastive Learning for Vision-and-Language Evaluation and Training}},
  author  = {Sarto, Sara and Moratelli, Nicholas and Cornia, Marcella and Baraldi, Lorenzo and Cucchiara, Rita},
  journal = {International Journal of Computer Vision},
  year    = {2025}
}"""
CODE = ("https://github.com/aimagelab/pacscore",)
FILES = {("pacs", "vit-b-32"): "clip_ViT-B-32.pth", ("pacs", "open_clip-vit-l-14"): "openClip_ViT-L-14.pth",
         ("pacs_pp", "vit-b-32"): "PAC++_clip_ViT-B-32.pth", ("pacs_pp", "vit-l-14"): "PAC++_clip_ViT-L-14.pth"}


def official_harmonic_mean(p: Tensor, s: Tensor) -> Tensor:
    """``2 p s / (p + s)`` as compute_metrics.py computes it, without clipping either side; 0 where ``p + s`` is 0
    (the official code divides by zero there)."""
    total = p + s
    safe = torch.where(total == 0, torch.ones_like(total), total)
    return torch.where(total == 0, torch.zeros_like(total), 2 * p * s / safe)


@dataclass
class PACScoreConfig(CLIPScoreConfig):
    # "" = the folder `capeval convert pacs` writes for `backbone`; or any converted folder / CLIP checkpoint.
    model: str = ""
    # "vit-b-32" (CLIP ViT-B/32, the paper's main rows) or "open_clip-vit-l-14" (OpenCLIP ViT-L/14).
    backbone: str = "vit-b-32"
    w: float = bounded(2.0, gt=0)
    prefix: str = "A photo depicts"
    # The official code prefixes references too and does not clip their similarity at 0.
    prefix_references: bool = True
    clamp_reference: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        # PAC-S runs its CLIP as the official code does, always: CLIPScore's other choices would be ignored
        if self.preprocessing != "official" or self.quantize != "none" or self.compile:
            raise ValueError("PAC-S: preprocessing, quantize and compile are CLIPScore's options; PAC-S and PAC-S++ "
                             "feed their CLIP as their official code does (preprocessing='official', no quantize, "
                             "no compile)")


@dataclass
class PACScorePPConfig(PACScoreConfig):
    # "vit-l-14" (the official PAC-S++ script's backbone) or "vit-b-32".
    backbone: str = "vit-l-14"


class PACScore(CLIPScore):
    variant: ClassVar[str] = "pacs"
    info = MetricInfo(
        name="pacscore",
        display_name="PAC-S",
        description=(
            "Reference-free: w * max(cos(image, 'A photo depicts ' + caption), 0), w = 2, on CLIP fine-tuned with "
            "positive-augmented contrastive learning (the released PAC-S weights). With references and "
            "reference_extras=True, RefPAC-S comes as an extra."
        ),
        citation=CITATION,
        references="optional",
        images="always",
        score_range=(0.0, 2.0),
        paper="https://arxiv.org/abs/2303.12112",
        paper_config={"backbone": "CLIP ViT-B/32 (clip_ViT-B-32.pth)", "w": 2.0, "prefix": "A photo depicts"},
        codebase_urls=CODE,
    )
    Config = PACScoreConfig
    extra_names: ClassVar[tuple[str, ...]] = ("cosine", "reference_similarity", "refpacscore")
    optional_extras: ClassVar[tuple[str, ...]] = ("reference_similarity", "refpacscore")
    mean_extras: ClassVar[tuple[str, ...]] = ("refpacscore",)

    def __init__(self, **config):
        super().__init__(**config)
        backbones = sorted(b for v, b in FILES if v == self.variant)
        if self.config.backbone not in backbones:
            raise ValueError(f"{self.info.name}: backbone must be one of {backbones}, got {self.config.backbone!r}")

    def checkpoint(self) -> str:
        """The converted folder this metric loads: ``model``, else the default for ``backbone``."""
        return self.config.model or str(converted_model_dir(f"{self.variant}-{self.config.backbone}"))

    def requirements(self) -> list[Requirement]:
        needs = super().requirements()
        if not self.config.model:
            from capeval_plugins.resources.releases import release

            released = release(f"{self.variant}-{self.config.backbone}")
            needs.append(Requirement(
                "model", self.checkpoint(), f"the {self.info.display_name} weights (backbone {self.config.backbone})",
                remedy=f"run `capeval fetch-weights {released.name}` (downloads {released.file} from {released.url}, "
                       f"checks and converts it), or convert a copy with `capeval convert pacs {released.file}`, or "
                       "pass model=FOLDER"))
        needs.append(Requirement("module", "ftfy", f"{self.info.name}'s text cleaning (as clip.tokenize)",
                                 install_extra("pacs")))
        return needs

    @property
    def encoder(self) -> OfficialClip:
        folder = self.checkpoint()
        self._check_variant(folder)
        return OfficialClip.shared(EncoderSpec.from_config(self.config, model=folder))

    def _check_variant(self, folder: str) -> None:
        """A folder `capeval convert pacs` wrote names its variant and backbone: PAC-S weights under pacscore_pp
        (or the reverse) are refused, and so is a ``backbone`` given beside ``model`` that the folder's is not
        (the folder decides what runs: the option changed nothing)."""
        record = Path(folder) / "conversion.json"
        if not record.is_file():
            return
        try:
            found = json.loads(record.read_text())
            variant, backbone = found.get("variant"), found.get("backbone")
        except (OSError, ValueError, AttributeError):
            return
        if variant and variant != self.variant:
            raise ValueError(f"{self.info.name}: {folder} holds {variant} weights; use "
                             f"{'pacscore_pp' if variant == 'pacs_pp' else 'pacscore'}")
        default = next(f.default for f in dataclasses.fields(self.Config) if f.name == "backbone")
        if backbone and backbone != self.config.backbone and self.config.backbone != default:
            raise ValueError(f"{self.info.name}: {folder} holds {backbone} weights (its conversion.json), not "
                             f"backbone={self.config.backbone!r}; drop backbone (the folder decides) or give that "
                             "backbone's folder")

    def combine(self, score: Tensor, reference_similarity: Tensor) -> Tensor:
        return official_harmonic_mean(score, reference_similarity)

    def arrange(self, clip_s: Tensor, cosine: Tensor, ref_sim: Tensor, refpac: Tensor) -> dict[str, Tensor]:
        return {"score": clip_s, "cosine": cosine, "reference_similarity": ref_sim, "refpacscore": refpac}


class RefPACScore(PACScore):
    info = MetricInfo(
        name="refpacscore",
        display_name="RefPAC-S",
        description=(
            "2 p s / (p + s) of PAC-S p and the best cosine s between the candidate and a reference in the PAC-S "
            "CLIP text space (not clipped, as the official code)."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=None,  # the official combination is unbounded where s < 0 (never met on trained weights)
        paper="https://arxiv.org/abs/2303.12112",
        paper_config={"backbone": "CLIP ViT-B/32 (clip_ViT-B-32.pth)", "w": 2.0, "prefix": "A photo depicts"},
        codebase_urls=CODE,
    )
    extra_names: ClassVar[tuple[str, ...]] = ("pacscore", "cosine", "reference_similarity")
    optional_extras: ClassVar[tuple[str, ...]] = ()
    mean_extras: ClassVar[tuple[str, ...]] = ("pacscore",)

    def arrange(self, clip_s: Tensor, cosine: Tensor, ref_sim: Tensor, refpac: Tensor) -> dict[str, Tensor]:
        return {"score": refpac, "pacscore": clip_s, "cosine": cosine, "reference_similarity": ref_sim}


class PACScorePP(PACScore):
    variant: ClassVar[str] = "pacs_pp"
    info = MetricInfo(
        name="pacscore_pp",
        display_name="PAC-S++",
        description=(
            "PAC-S's formula on the CLIP of PAC-S++ (LoRA fine-tuning with positive augmentations and curated "
            "negatives; the released PAC++ weights). With references and reference_extras=True, RefPAC-S++ comes as an "
            "extra."
        ),
        citation=CITATION_PP,
        references="optional",
        images="always",
        score_range=(0.0, 2.0),
        paper="https://arxiv.org/abs/2410.07336",
        paper_config={"backbone": "CLIP ViT-L/14 with LoRA r=4 (PAC++_clip_ViT-L-14.pth)", "w": 2.0,
                      "prefix": "A photo depicts"},
        codebase_urls=CODE,
    )
    Config = PACScorePPConfig
    extra_names: ClassVar[tuple[str, ...]] = ("cosine", "reference_similarity", "refpacscore_pp")
    optional_extras: ClassVar[tuple[str, ...]] = ("reference_similarity", "refpacscore_pp")
    mean_extras: ClassVar[tuple[str, ...]] = ("refpacscore_pp",)

    def arrange(self, clip_s: Tensor, cosine: Tensor, ref_sim: Tensor, refpac: Tensor) -> dict[str, Tensor]:
        return {"score": clip_s, "cosine": cosine, "reference_similarity": ref_sim, "refpacscore_pp": refpac}


class RefPACScorePP(PACScorePP):
    info = MetricInfo(
        name="refpacscore_pp",
        display_name="RefPAC-S++",
        description="RefPAC-S's combination with references on the CLIP of PAC-S++.",
        citation=CITATION_PP,
        references="always",
        images="always",
        score_range=None,
        paper="https://arxiv.org/abs/2410.07336",
        paper_config={"backbone": "CLIP ViT-L/14 with LoRA r=4 (PAC++_clip_ViT-L-14.pth)", "w": 2.0,
                      "prefix": "A photo depicts"},
        codebase_urls=CODE,
    )
    extra_names: ClassVar[tuple[str, ...]] = ("pacscore_pp", "cosine", "reference_similarity")
    optional_extras: ClassVar[tuple[str, ...]] = ()
    mean_extras: ClassVar[tuple[str, ...]] = ("pacscore_pp",)

    def arrange(self, clip_s: Tensor, cosine: Tensor, ref_sim: Tensor, refpac: Tensor) -> dict[str, Tensor]:
        return {"score": refpac, "pacscore_pp": clip_s, "cosine": cosine, "reference_similarity": ref_sim}


METRICS = [PACScore, RefPACScore, PACScorePP, RefPACScorePP]
