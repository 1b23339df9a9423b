"""VELA (Matsuda et al., EMNLP 2025): an LLM-Hybrid-as-a-Judge metric for long captions, in three aspects
(Descriptiveness, Relevance, Fluency). A text-only LLM reads the references and the candidate in one
non-autoregressive pass (R2C-LLM); Long-CLIP compares the image and the candidate (I2C-Align); a trained head maps
both to a score in [0, 1] per aspect (see :mod:`capeval_plugins.models.encoders.vela`).

The weights are the released checkpoint (``vela_regressor.safetensors``: the LLM's LoRA factors and the head) with
Long-CLIP-L (``longclip-L.pt``) and Qwen2.5-3B-Instruct, combined by ``capeval convert vela`` into one folder:
``llm/`` (the LLM with LoRA folded in, and its tokenizer), ``clip/`` (Long-CLIP as a transformers CLIP, 248 text
positions) and the head at the top.
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
from capeval_plugins.core.messages import install_extra

if TYPE_CHECKING:
    from capeval_plugins.models.encoders.vela import VelaHead

CITATION = """@inproceedings{matsuda2025vela,
  title     = {{VELA}: An {LLM}-Hybrid-as-a-Judge Approach for Evaluating Long Image Captions},
  author    = {Matsuda, Kazuki and Wada, Yuiga and Hirano, Shinnosuke and Otsuki, Seitaro and Sugiura, Komei},
  booktitle = {Proceedings of EMNLP},
  year      = {2025}
}"""
ASPECTS = ("desc", "rel", "flu")
RELEASES = ("vela_regressor.safetensors (Hugging Face Ka2ukiMatsuda/vela), longclip-L.pt (Hugging Face "
            "BeichenZhang/LongCLIP-L) and Qwen/Qwen2.5-3B-Instruct")


@dataclass
class VELAConfig(ModelConfig):
    # "" = the folder `capeval convert vela` writes; or any converted VELA folder.
    model: str = ""
    # The aspect that is the score: "desc" (Descriptiveness), "rel" (Relevance) or "flu" (Fluency); all three come
    # as extras. Each LongCap-Arena benchmark sets its own.
    aspect: str = "desc"
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.aspect not in ASPECTS:
            raise ValueError(f"vela: aspect must be one of {ASPECTS}, got {self.aspect!r}")


class VELA(PointwiseMetric):
    info = MetricInfo(
        name="vela",
        display_name="VELA",
        description=(
            "Long-caption evaluation (LLM-Hybrid-as-a-Judge): Qwen2.5-3B reads the references and the candidate in "
            "one pass, Long-CLIP compares image and candidate, a trained head scores Descriptiveness, Relevance and "
            "Fluency in [0, 1] (the `aspect` option picks the score; all three are extras). Needs references and "
            "the released checkpoint."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=(0.0, 1.0),
        paper="https://arxiv.org/abs/2509.25818",
        paper_config={"checkpoint": "vela_regressor.safetensors", "llm": "Qwen/Qwen2.5-3B-Instruct (LoRA r=4, "
                      "alpha=16, q_proj / v_proj)", "clip": "Long-CLIP-L (longclip-L.pt)",
                      "head": "sigmoid(W [g_r2c, g_i2c, aspect embedding] + b)"},
        codebase_urls=("https://github.com/Ka2ukiMatsuda/VELA",),
    )
    Config = VELAConfig
    extra_names: ClassVar[tuple[str, ...]] = ASPECTS

    def checkpoint(self) -> str:
        return self.config.model or str(converted_model_dir("vela"))

    def requirements(self) -> list[Requirement]:
        needs = super().requirements()
        if not self.config.model:
            needs.append(Requirement("model", self.checkpoint(), "the VELA weights",
                                     remedy=f"download {RELEASES} and run `capeval convert vela "
                                            "vela_regressor.safetensors --long-clip longclip-L.pt`, or pass "
                                            "model=FOLDER"))
        needs.append(Requirement("module", "ftfy", "vela's Long-CLIP text cleaning (as clip.tokenize)",
                                 install_extra("pacs")))
        return needs

    def spec(self, folder: str | Path) -> EncoderSpec:
        return EncoderSpec.from_config(self.config, model=str(folder))

    @property
    def head(self) -> VelaHead:
        from capeval_plugins.models.encoders.vela import VelaHead

        return loading.load_spec(VelaHead, self.spec(self.checkpoint()))

    @property
    def llm(self):
        from transformers import AutoModel

        return loading.load_spec(AutoModel, self.spec(Path(self.checkpoint()) / "llm"), gpu_dtype=torch.bfloat16)

    @property
    def tokenizer(self):
        from transformers import AutoTokenizer

        cfg = self.config
        return loading.load_processor(AutoTokenizer, str(Path(self.checkpoint()) / "llm"), revision=cfg.revision,
                                      local_files_only=cfg.local_files_only)

    @property
    def clip(self) -> OfficialClip:
        return OfficialClip.shared(self.spec(Path(self.checkpoint()) / "clip"))

    @torch.inference_mode()
    def r2c(self, prompts: list[str]) -> Tensor:
        """g_r2c of every prompt of the batch in one LLM pass: each prompt tokenised alone and right-padded, so a
        text's hidden states are the ones it has unpadded (the LLM is causal)."""
        from capeval_plugins.models.encoders.vela import r2c_features

        llm, tokenizer = self.llm, self.tokenizer
        ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
        width = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        device = loading.input_device(llm, self.config.device)
        hidden = llm(input_ids=input_ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        return r2c_features(hidden, mask.to(hidden.device))

    def score(self, batch: Batch) -> dict[str, Tensor]:
        from capeval_plugins.models.encoders.vela import format_prompt, i2c_features

        head, clip = self.head, self.clip
        prompts = [format_prompt(head.config.prompt, refs, cand)
                   for refs, cand in zip(batch.references, batch.candidates)]
        r2c = self.r2c(prompts)
        with torch.inference_mode():
            image = clip.image_features(batch.images)[batch.image_index.to(clip.device)]
            text = clip.text_features(list(batch.candidates))
            device = head.device
            i2c = i2c_features(head.normalize(image).to(device), head.normalize(text).to(device))
            scores = head(r2c.to(device), i2c).double().cpu()
        out = {aspect: scores[:, i] for i, aspect in enumerate(head.config.aspects)}
        return {"score": out[self.config.aspect], **{a: out[a] for a in ASPECTS}}


METRICS = [VELA]
