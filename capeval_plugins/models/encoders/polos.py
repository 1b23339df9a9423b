"""Polos (Wada et al., CVPR 2024): the released model as one transformers ``PreTrainedModel`` (its SimCSE-RoBERTa
text encoder, the layer-wise scalar mix and the regressor) beside an OpenAI-layout CLIP ViT-B/32 (a ``clip/``
sub-folder, run by :class:`~capeval_plugins.models.encoders.openai_clip.OfficialClip`).

For a candidate c, a reference r and an image v (``PolosEstimator.forward`` of keio-smilab24/Polos):

    t(x)  = CLS of gamma * sum_k softmax(s)_k * LN_k(h_k(x))      (h_k: the 13 hidden states, LN_k: one mean and
                                                                     variance over all of x's token features)
    u(x)  = CLIP text embedding of "A photo depicts " + x,  e = CLIP image embedding (both unnormalised)
    f(c, r, v) = sigmoid(MLP([t(r), t(c), |t(c) - t(r)|, t(c) * t(r), e, u(c), |e - u(c)|, e * u(c),
                              |u(r) - u(c)|, u(r) * u(c)]))
    Polos(c, R, v) = max_{r in R} f(c, r, v)

The official ``predict`` takes LN_k's mean and variance over every text of its batch at once (the candidates
together, each reference slot together) and, in a batch whose samples have different numbers of references, uses
only as many references as the sample with the fewest. By default they are taken over each text's own tokens and
every reference is used: the official scores with ``batch_size=1``, which do not depend on the other samples.
The batched reading (the metric's ``official_batch_size``) pools them from per-text sums
(:func:`layer_sums`, :func:`pooled_statistics`).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from capeval_plugins.models.encoders.common import segment_max

ACTIVATIONS = ("Tanh", "Sigmoid", "ReLU", "GELU", "Identity")


class PolosConfig(PretrainedConfig):
    """``encoder_config``: the RoBERTa encoder's configuration; ``hidden_sizes``: the regressor's hidden layers
    (released: 2304, 1152); ``activation``: between them (released: Tanh); ``final_activation``: before the
    closing sigmoid (released: none); ``clip_dim``: CLIP's embedding size (512); ``prefix``: CLIP's text prompt."""

    model_type = "capeval_polos"

    def __init__(self, encoder_config: dict | None = None, hidden_sizes: Sequence[int] = (2304, 1152),
                 activation: str = "Tanh", final_activation: str | None = None, clip_dim: int = 512,
                 prefix: str = "A photo depicts ", **kwargs: Any) -> None:
        self.encoder_config = dict(encoder_config or {})
        self.hidden_sizes = [int(h) for h in hidden_sizes]
        self.activation = activation
        self.final_activation = final_activation
        self.clip_dim = int(clip_dim)
        self.prefix = prefix
        super().__init__(**kwargs)

    def check(self) -> None:
        for name in (self.activation, self.final_activation or "Identity"):
            if name not in ACTIVATIONS:
                raise ValueError(f"Polos: activation {name!r} is not one of {ACTIVATIONS}")


def _activation(name: str | None) -> nn.Module:
    return getattr(nn, name or "Identity")()


class PolosModel(PreTrainedModel):
    """The text encoder, the scalar mix over its layers and the regressor of a released Polos checkpoint."""

    config_class = PolosConfig
    base_model_prefix = "polos"

    def __init__(self, config: PolosConfig):
        from transformers import RobertaConfig, RobertaModel

        config.check()
        super().__init__(config)
        text = RobertaConfig(**config.encoder_config)
        self.text_encoder = RobertaModel(text, add_pooling_layer=False)
        layers = text.num_hidden_layers + 1  # the embeddings and every layer
        self.mix_weights = nn.Parameter(torch.zeros(layers))
        self.mix_gamma = nn.Parameter(torch.ones(1))
        sizes = [4 * text.hidden_size + 6 * config.clip_dim, *config.hidden_sizes, 1]
        blocks: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            blocks.append(nn.Linear(n_in, n_out))
            blocks.append(_activation(config.activation if i < len(sizes) - 2 else config.final_activation))
        self.regressor = nn.Sequential(*blocks)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.bias.data.zero_()

    def sentence_embeddings(self, input_ids: Tensor, attention_mask: Tensor,
                            statistics: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """t(x) for a padded batch (B, L): the CLS row of the scalar mix of every hidden state, each normalised
        by the mean and variance of its text's own token features, or by ``statistics`` (means, variances:
        (B, K) each, K = hidden states) given per text (the official batched reading, see
        :func:`pooled_statistics`)."""
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        own = layer_sums(out.hidden_states, attention_mask) if statistics is None else None
        weights = torch.softmax(self.mix_weights, dim=0)
        mixed = 0
        for k, (weight, hidden) in enumerate(zip(weights, out.hidden_states)):
            if statistics is None:
                mean, variance = pooled_statistics(*(part[:, k:k + 1] for part in own), groups=None)
                mean, variance = mean[:, 0], variance[:, 0]
            else:
                mean, variance = statistics[0][:, k], statistics[1][:, k]
            mean, variance = mean.to(hidden.dtype), variance.to(hidden.dtype)
            mixed = mixed + weight * (hidden[:, 0] - mean[:, None]) / torch.sqrt(variance[:, None] + 1e-12)
        return self.mix_gamma * mixed

    @torch.inference_mode()
    def text_statistics(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per text and hidden state, what the scalar mix's layer norm sums: see :func:`layer_sums`."""
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return layer_sums(out.hidden_states, attention_mask)

    def score(self, candidate: Tensor, references: Tensor, owner: Tensor, image: Tensor, clip_candidate: Tensor,
              clip_references: Tensor) -> Tensor:
        """Polos per candidate: ``candidate`` (N, H) and ``clip_candidate`` / ``image`` (N, D) per candidate;
        ``references`` (R, H) and ``clip_references`` (R, D) flattened, ``owner`` (R,) their candidate; the
        highest f over each candidate's references (-inf for a candidate without any)."""
        mt, ref = candidate[owner], references
        img, mtc, refc = image[owner], clip_candidate[owner], clip_references
        x = torch.cat((ref, mt, (mt - ref).abs(), mt * ref, img, mtc, (img - mtc).abs(), img * mtc,
                       (refc - mtc).abs(), refc * mtc), dim=1)
        per_reference = torch.sigmoid(self.regressor(x)).squeeze(-1)
        return segment_max(per_reference, owner, len(candidate))


def layer_sums(hidden_states: Sequence[Tensor], attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(sum, sum of squares, count)`` of each text's token features per hidden state, in float64: (B, K) each
    (count: tokens x width). The scalar mix's layer norm over a set of texts is a function of their sums."""
    mask = attention_mask.to(torch.float64)[..., None]                           # (B, L, 1)
    totals, squares = [], []
    for hidden in hidden_states:  # one layer at a time in float64
        masked = hidden.to(torch.float64) * mask
        totals.append(masked.sum((1, 2)))
        squares.append(masked.square().sum((1, 2)))
    total, squares = torch.stack(totals, 1), torch.stack(squares, 1)
    count = (mask.sum((1, 2)) * hidden_states[0].shape[-1])[:, None].expand_as(total)
    return total, squares, count


def pooled_statistics(total: Tensor, squares: Tensor, count: Tensor, groups: Tensor | None) -> tuple[Tensor, Tensor]:
    """Mean and variance of the token features of each group of texts, per hidden state, given per-text
    :func:`layer_sums` (N, K); ``groups`` (N,) a group id per text (None: each text alone). Returned per text,
    (N, K) each: the statistics of its group."""
    if groups is not None:
        n = int(groups.max()) + 1 if len(groups) else 0
        pool = lambda x: x.new_zeros((n, x.shape[1])).index_add_(0, groups, x)[groups]  # noqa: E731
        total, squares, count = pool(total), pool(squares), pool(count)
    mean = total / count
    return mean, (squares / count - mean.square()).clamp_min(0)


def flatten_references(references: Sequence[Sequence[str]]) -> tuple[list[str], Tensor]:
    """Every reference in one list, and the index of the candidate each belongs to."""
    flat = [r for refs in references for r in refs]
    owner = torch.tensor([i for i, refs in enumerate(references) for _ in refs], dtype=torch.long)
    return flat, owner

