"""Rigel (Koyama et al., 2026): an LVLM reads the image or video, the candidate (and references, when given)
in the paper's prompt; a scoring head g distilled from the LVLM (phase 1) and a LoRA-adapted backbone (phase
2) give the score distribution p = softmax(g(h)) at the score position in one forward pass, and the score is
(sum_k k p_k - 1) / 4 on [0, 1].

No Rigel weights are public: scores need a checkpoint trained with ``capeval train rigel`` (see
:mod:`capeval_plugins.training`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, ModelConfig, PointwiseMetric, Requirement
from capeval_plugins.core.messages import install_extra
from capeval_plugins.models.rigel import (ADAPTER_DIR, RigelModel, load_rigel, read_settings,
                                          scores_from_probabilities)

CITATION = """@article{koyama2026rigel,
  title   = {Rigel: Self-Distilled Score Adaptation for Image and Video Captioning Evaluation},
  author  = {Koyama, Shuitsu and Matsuda, Kazuki and Wada, Yuiga and Hirano, Shinnosuke and Yashima, Daichi and
             Sugiura, Komei},
  journal = {arXiv preprint arXiv:2606.29997},
  year    = {2026}
}"""

HEADS: tuple[str, ...] = ("checkpoint", "scoring", "lm")

NO_CHECKPOINT = (
    "rigel needs a trained checkpoint (checkpoint=PATH): no Rigel weights are public. Train one with "
    "`capeval train rigel --phase 1 --train DATA --out rigel-p1`, then `capeval train rigel --phase 2 --init "
    "rigel-p1 --train DATA --out rigel` (see docs/training.md), and pass checkpoint='rigel'"
)


@dataclass
class RigelConfig(ModelConfig):
    batch_size: int = 16
    # A trained checkpoint folder (required: no weights are public).
    checkpoint: str = ""
    # The base LVLM; "" = the one the checkpoint names (Qwen/Qwen3-VL-2B-Instruct by default).
    model: str = ""
    # Merge the LoRA adapter into the weights once at load (faster); False keeps it separate.
    merge_lora: bool = True
    # Which head reads the score: "checkpoint" (the one it was trained with: its scoring head g, or the LM head
    # for a checkpoint trained against it, the paper's Table 3 row (i)), "scoring" (g) or "lm" (the LM head's
    # label tokens "1".."5", softmax over them, whatever the checkpoint was trained with).
    head: str = "checkpoint"
    input_paths: ClassVar[tuple[str, ...]] = ("checkpoint", "model")


class Rigel(PointwiseMetric):
    info = MetricInfo(
        name="rigel",
        display_name="Rigel",
        description=(
            "An LVLM judge whose score distribution comes from a scoring head distilled from its own LM head "
            "(phase 1) on a LoRA-adapted backbone (phase 2), read at the score position in one forward pass; "
            "images or videos (lists of frames), with or without references. Needs a trained checkpoint."
        ),
        citation=CITATION,
        references="optional",
        images="always",
        video=True,
        score_range=(0.0, 1.0),
        paper="https://arxiv.org/abs/2606.29997",
        paper_config={"model": "Qwen3-VL-2B", "labels": "1-5", "phase 1": "tau * EMD, Adam 5e-4, batch 64",
                      "phase 2": "LoRA r=8 alpha=16, cross-entropy, Adam 1e-4, batch 8, 1 epoch"},
    )
    Config = RigelConfig
    extra_names: ClassVar[tuple[str, ...]] = ("expected_label", "distribution")
    extra_shapes: ClassVar[dict[str, tuple[int, ...]]] = {"distribution": (5,)}
    mean_extras: ClassVar[tuple[str, ...]] = ("expected_label",)

    def __init__(self, **config):
        super().__init__(**config)
        if not self.config.checkpoint:
            raise ValueError(NO_CHECKPOINT)
        if self.config.head not in HEADS:
            raise ValueError(f"rigel: head must be one of {HEADS}, got {self.config.head!r}")
        settings = read_settings(self.config.checkpoint)
        if self.config.head == "scoring" and settings.head == "lm":
            raise ValueError(f"rigel: checkpoint {self.config.checkpoint} was trained against the LM head and has no "
                             "scoring head; use head='lm' (or 'checkpoint')")
        # The label count of this checkpoint (the paper's 1..5 unless trained otherwise), read without the model.
        self.extra_shapes = {"distribution": (len(settings.labels),)}

    def requirements(self) -> list[Requirement]:
        """The base LVLM (``model``, else the one the checkpoint names) and, for a LoRA adapter, peft."""
        cfg, settings = self.config, read_settings(self.config.checkpoint)
        needs = super().requirements()
        if not cfg.model:
            needs.append(Requirement("model", settings.base_model, f"the base model of checkpoint {cfg.checkpoint}",
                                     revision=cfg.revision or settings.revision, local_files_only=cfg.local_files_only))
        if (Path(cfg.checkpoint) / ADAPTER_DIR).is_dir():
            needs.append(Requirement("module", "peft", f"the LoRA adapter of checkpoint {cfg.checkpoint}",
                                     install_extra("lora")))
        return needs

    @property
    def model(self) -> RigelModel:
        cfg = self.config
        return load_rigel(cfg.checkpoint, model=cfg.model or None, device=cfg.device, dtype=cfg.dtype,
                          revision=cfg.revision, local_files_only=cfg.local_files_only,
                          trust_remote_code=cfg.trust_remote_code, merge_lora=cfg.merge_lora,
                          device_map=cfg.device_map, max_memory=cfg.max_memory, offload_folder=cfg.offload_folder)

    def score(self, batch: Batch) -> dict[str, Tensor]:
        head = None if self.config.head == "checkpoint" else self.config.head
        probs = self.model.probabilities(batch.images, batch.image_index, batch.candidates, batch.references,
                                         batch_size=self.config.batch_size, head=head)
        expected, score = scores_from_probabilities(probs)
        return {"score": score, "expected_label": expected, "distribution": probs.to(torch.float64)}


METRICS = [Rigel]
