"""VELA (Matsuda et al., EMNLP 2025): its two branches' features and its scoring head, on tensors.

For a candidate c, its references R and an image v (the paper's Section 3):

    g_r2c = [ mean_i h_i ; h_M ]              h_1..h_M: the LLM's last hidden states of the prompt made of R and c
                                              (Qwen2.5-3B-Instruct with LoRA, read in one non-autoregressive pass)
    g_i2c = [ |e_v - e_c| ; e_v * e_c ]       e_v, e_c: Long-CLIP's image and text embeddings (248 text tokens)
    y_a   = sigmoid(W [g_r2c, g_i2c, m_a] + b)  a in (desc, rel, flu); m_a a learnt embedding of the aspect

The paper writes one linear layer with three outputs; the released configuration (``mode_embed_dim: 8``) instead
feeds an embedding of the aspect to a head with one output, scored once per aspect. Both layouts load here: a head
whose last layer has one output per aspect and no aspect embedding, or one output and an aspect embedding. How the
head's input is ordered, its activation between layers and its closing squashing are configuration
(:class:`VelaHeadConfig`), read by ``capeval convert vela`` from the released files where they say it.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

ASPECTS = ("desc", "rel", "flu")
BRANCHES = ("r2c", "i2c", "mode")
ACTIVATIONS = ("Tanh", "ReLU", "GELU", "Sigmoid", "Identity")
OUTPUTS = ("sigmoid", "clamp")
# The R2C prompt: the references, one per line, then the candidate. Not the official wording (see the card).
DEFAULT_PROMPT = ("Evaluate the candidate caption of an image against the reference captions.\n"
                  "Reference captions:\n{references}\nCandidate caption:\n{candidate}")


def r2c_features(hidden: Tensor, mask: Tensor) -> Tensor:
    """``[mean of the hidden states ; the last one]`` per text of a right-padded batch (B, L, H), over its own
    tokens (``mask`` (B, L)); float32."""
    weight = mask.to(torch.float32)[..., None]
    mean = (hidden.float() * weight).sum(1) / weight.sum(1).clamp_min(1)
    last = hidden[torch.arange(hidden.shape[0], device=hidden.device), mask.long().sum(1).clamp_min(1) - 1]
    return torch.cat((mean, last.float()), dim=-1)


def i2c_features(image: Tensor, candidate: Tensor) -> Tensor:
    """``[|image - candidate| ; image * candidate]`` of (N, D) embeddings; float32."""
    image, candidate = image.float(), candidate.float()
    return torch.cat(((image - candidate).abs(), image * candidate), dim=-1)


def format_prompt(template: str, references: Sequence[str], candidate: str) -> str:
    """The R2C prompt: ``{references}`` (one per line) and ``{candidate}`` filled in; any other brace in the
    template or the texts is left as it is."""
    return template.replace("{references}", "\n".join(references)).replace("{candidate}", candidate)


class VelaHeadConfig(PretrainedConfig):
    """``llm_hidden`` / ``clip_dim``: the LLM's hidden size and Long-CLIP's embedding size; ``mode_embed_dim``: the
    aspect embedding's width (0: none, the head then has one output per aspect); ``hidden_sizes``: the head's hidden
    layers (the paper: none); ``activation``: between them; ``output``: ``"sigmoid"`` (the paper) or ``"clamp"``
    (the raw output clipped to [0, 1]); ``feature_order``: the order of ``r2c``, ``i2c`` and ``mode`` in the head's
    input; ``normalize_clip``: L2-normalise Long-CLIP's embeddings first; ``prompt``: the R2C template."""

    model_type = "capeval_vela"

    def __init__(self, llm_hidden: int = 2048, clip_dim: int = 768, mode_embed_dim: int = 8,
                 hidden_sizes: Sequence[int] = (), activation: str = "Tanh", output: str = "sigmoid",
                 feature_order: Sequence[str] = BRANCHES, aspects: Sequence[str] = ASPECTS,
                 normalize_clip: bool = False, prompt: str = DEFAULT_PROMPT, **kwargs: Any) -> None:
        self.llm_hidden, self.clip_dim, self.mode_embed_dim = int(llm_hidden), int(clip_dim), int(mode_embed_dim)
        self.hidden_sizes = [int(h) for h in hidden_sizes]
        self.activation, self.output = activation, output
        self.feature_order = [str(f) for f in feature_order]
        self.aspects = [str(a) for a in aspects]
        self.normalize_clip, self.prompt = bool(normalize_clip), str(prompt)
        super().__init__(**kwargs)

    def check(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"VELA: activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.output not in OUTPUTS:
            raise ValueError(f"VELA: output {self.output!r} is not one of {OUTPUTS}")
        wanted = set(BRANCHES) if self.mode_embed_dim else {"r2c", "i2c"}
        if sorted(self.feature_order) != sorted(wanted):
            raise ValueError(f"VELA: feature_order must order {sorted(wanted)}, got {self.feature_order}")
        if "{candidate}" not in self.prompt:
            raise ValueError("VELA: the prompt template has no {candidate}")

    @property
    def input_size(self) -> int:
        return 2 * self.llm_hidden + 2 * self.clip_dim + self.mode_embed_dim

    @property
    def outputs(self) -> int:
        return 1 if self.mode_embed_dim else len(self.aspects)


class VelaHead(PreTrainedModel):
    """The aspect embedding and the scoring head of a released VELA checkpoint."""

    config_class = VelaHeadConfig
    base_model_prefix = "vela"

    def __init__(self, config: VelaHeadConfig):
        config.check()
        super().__init__(config)
        if config.mode_embed_dim:
            self.mode_embedding = nn.Embedding(len(config.aspects), config.mode_embed_dim)
        sizes = [config.input_size, *config.hidden_sizes, config.outputs]
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(n_in, n_out))
            if i < len(sizes) - 2:
                layers.append(getattr(nn, config.activation)())
        self.head = nn.Sequential(*layers)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)

    def forward(self, r2c: Tensor, i2c: Tensor) -> Tensor:
        """(N, aspects) scores from the branch features ``r2c`` (N, 2H) and ``i2c`` (N, 2D)."""
        cfg = self.config
        dtype = self.head[0].weight.dtype
        n, aspects = r2c.shape[0], len(cfg.aspects)
        parts = {"r2c": r2c.to(dtype), "i2c": i2c.to(dtype)}
        if cfg.mode_embed_dim:  # every aspect's input at once: (N, A, F) through the head, one output each
            parts = {k: v[:, None].expand(n, aspects, v.shape[-1]) for k, v in parts.items()}
            parts["mode"] = self.mode_embedding.weight[None].expand(n, aspects, cfg.mode_embed_dim)
        raw = self.head(torch.cat([parts[name] for name in cfg.feature_order], dim=-1))
        raw = raw.squeeze(-1) if cfg.mode_embed_dim else raw
        return torch.sigmoid(raw) if cfg.output == "sigmoid" else raw.clamp(0.0, 1.0)

    def normalize(self, features: Tensor) -> Tensor:
        """Long-CLIP embeddings as the head takes them (L2-normalised where the configuration says so)."""
        return torch.nn.functional.normalize(features.float(), dim=-1) if self.config.normalize_clip else features
