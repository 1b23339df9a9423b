"""MSD-Score's official COCO-CF loop (SteinsGateSg/MSDScore, metrics/vMF_MSD_Score/coco_eval_cf.py), written out
from what it computes, as the reference the tests and ``benchmarks/msd_whole_run.py`` run beside
``preset="coco-cf"``: per pair i (its index in the data list), the image's mixture fitted with a generator seeded
seed + 7 i, each caption's with seed + 3 i + 123 (both captions the same), starting means the first K of
torch.randperm(N); x / (|x| + 1e-6); no re-initialisation; float32. The benchmark pastes the EM's source into
its script for the official side, so that side imports only torch and transformers, as the official code does.
"""
from __future__ import annotations

import numpy as np
import torch


def official_unit(x: torch.Tensor) -> torch.Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + 1e-6)


def official_fit(x: torch.Tensor, k: int, seed: int, kappa: float = 20.0, iterations: int = 20):
    x = official_unit(x)
    n = len(x)
    k = min(k, n)
    generator = torch.Generator()
    generator.manual_seed(seed)
    mu = official_unit(x[torch.randperm(n, generator=generator)[:k]].clone())
    w = torch.full((k,), 1.0 / k)
    for _ in range(iterations):
        post = torch.softmax(kappa * (x @ mu.T) + torch.log(w[None] + 1e-9), dim=1)
        mass = post.sum(0) + 1e-8
        mu = official_unit(post.T @ x)
        w = mass / float(n)
    return mu, w


def official_log_density(x: torch.Tensor, mixture, kappa: float = 20.0) -> torch.Tensor:
    mu, w = mixture
    return torch.logsumexp(kappa * (official_unit(x) @ mu.T) + torch.log(w[None] + 1e-9), dim=1)


@torch.no_grad()
def official_pair(model, processor, image, captions, i: int, seed: int) -> dict:
    pixels = processor(images=image, return_tensors="pt").pixel_values
    patches = official_unit(model.visual_projection(model.vision_model(pixels).last_hidden_state[:, 1:])[0])
    image_global = official_unit(model.get_image_features(pixel_values=pixels).pooler_output[0])
    image_mixture = official_fit(patches, 3, seed + 7 * i)
    out = {"bi_kl": [], "cosine": []}
    for caption in captions:
        tokens = processor(text=caption, return_tensors="pt", padding=True, truncation=True)
        hidden = model.text_projection(model.text_model(**tokens).last_hidden_state)
        length = int(tokens.attention_mask.sum())
        tok = official_unit((hidden[:, 1:length - 1] if length > 2 else hidden[:, :length])[0])
        text_global = official_unit(model.get_text_features(**tokens).pooler_output[0])
        text_mixture = official_fit(tok, 2, seed + 3 * i + 123)
        kl_it = (official_log_density(patches, image_mixture) - official_log_density(patches, text_mixture)).mean()
        kl_ti = (official_log_density(tok, text_mixture) - official_log_density(tok, image_mixture)).mean()
        beta = 1.0 / (1.0 + np.exp((len(tok) - 20.0) / 3.0))
        out["bi_kl"].append(float(beta * kl_it + (1.0 - beta) * kl_ti))
        out["cosine"].append(float(image_global @ text_global))
    cos, div = torch.tensor(out["cosine"]), torch.tensor(out["bi_kl"])
    u = torch.clamp(2.0 * (1.0 - torch.softmax(cos / 0.2, dim=0).max()), 0.0, 1.0)
    out["soft"] = (cos - 0.1 * u * div).tolist()
    return out
