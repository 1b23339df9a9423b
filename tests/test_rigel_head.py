"""Rigel's pure pieces: the 1-D EMD against scipy's Wasserstein distance, the temperature-scaled distillation
loss against a plain loop, gold labels against a plain loop, the head's and LoRA's parameter counts against
the paper's, and the prompts against the paper's text."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from conftest import ROOT

from capeval_plugins.core import heads
from capeval_plugins.models.rigel import paper_prompts, render_prompt

PAPER = ROOT.parent / "shared" / "papers" / "rigel.txt"


def random_simplex(rng: np.random.Generator, n: int, k: int = 5) -> np.ndarray:
    x = rng.gamma(0.5, size=(n, k))
    x[rng.random((n, k)) < 0.2] = 0.0  # some labels with no mass at all
    x[:, 0] += 1e-3
    return x / x.sum(1, keepdims=True)


def test_emd_equals_scipy_wasserstein_on_the_label_grid():
    from scipy.stats import wasserstein_distance

    rng = np.random.default_rng(0)
    p, q = random_simplex(rng, 200), random_simplex(rng, 200)
    ours = heads.emd_1d(torch.from_numpy(p), torch.from_numpy(q)).numpy()
    grid = np.arange(1, 6)
    expected = [wasserstein_distance(grid, grid, a, b) for a, b in zip(p, q)]
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-14)
    # a point mass moved from label i to label j costs |i - j|; identical distributions cost nothing
    eye = torch.eye(5, dtype=torch.float64)
    assert heads.emd_1d(eye[:, None], eye[None]).tolist() == [[abs(i - j) for j in range(5)] for i in range(5)]
    assert heads.emd_1d(torch.from_numpy(p), torch.from_numpy(p)).abs().max() == 0


def test_distillation_loss_is_tau_times_emd_of_the_tempered_softmaxes():
    rng = np.random.default_rng(1)
    head, teacher = rng.normal(0, 3, (50, 5)), rng.normal(0, 3, (50, 5))
    for tau in (0.5, 1.0, 2.0, 4.0):
        loss = heads.distillation_loss(torch.from_numpy(head), torch.from_numpy(teacher), tau).numpy()
        for i in range(50):
            q = np.exp(teacher[i] / tau) / np.exp(teacher[i] / tau).sum()
            p = np.exp(head[i] / tau) / np.exp(head[i] / tau).sum()
            emd = sum(abs(q[: j + 1].sum() - p[: j + 1].sum()) for j in range(4))
            assert loss[i] == pytest.approx(tau * emd, rel=1e-12, abs=1e-15)
    # any per-row shift of the teacher's logits (log-probabilities instead of logits) leaves it unchanged
    shifted = torch.from_numpy(teacher) + torch.from_numpy(rng.normal(0, 10, (50, 1)))
    assert torch.allclose(heads.distillation_loss(torch.from_numpy(head), shifted, 2.0),
                          heads.distillation_loss(torch.from_numpy(head), torch.from_numpy(teacher), 2.0), atol=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        heads.tempered_softmax(torch.zeros(1, 5), 0.0)


def test_distillation_loss_gradient_is_right():
    head = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    teacher = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert torch.autograd.gradcheck(lambda z: heads.distillation_loss(z, teacher, 1.5), (head,))


def test_expected_label_and_unit_score():
    probs = torch.tensor([[1.0, 0, 0, 0, 0], [0, 0, 0, 0, 1.0], [0.2] * 5, [0, 0.5, 0, 0.5, 0]], dtype=torch.float64)
    expected = heads.label_expectation(probs)
    assert expected.tolist() == [1.0, 5.0, 3.0, 3.0]
    assert heads.unit_score(expected, 5).tolist() == [0.0, 1.0, 0.5, 0.5]


def test_gold_labels_are_the_nearest_label_with_ties_as_asked():
    scores = np.round(np.linspace(0, 1, 81), 12)
    for ties in ("up", "down"):
        got = heads.gold_labels(torch.from_numpy(scores), 5, ties).tolist()
        for s, g in zip(scores, got):
            distance = [abs(s * 4 - k) for k in range(5)]
            best = min(distance)
            nearest = [k for k, d in enumerate(distance) if abs(d - best) < 1e-9]
            assert g == (max(nearest) if ties == "up" else min(nearest)), (s, ties)
    # the mean of a 3 and a 4 (on 1..5), normalised to [0, 1]: a tie
    assert heads.gold_labels(torch.tensor([0.625]), 5).item() == 3
    assert heads.gold_labels(torch.tensor([0.625]), 5, "down").item() == 2
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        heads.gold_labels(torch.tensor([1.5]), 5)


def test_scoring_head_has_the_papers_parameter_count_on_qwen3_vl_2b():
    # Appendix D: 2.63M trainable parameters on Qwen3-VL-2B, whose hidden size is 2048.
    head = heads.ScoringHead(2048)
    count = sum(p.numel() for p in head.parameters())
    assert round(count / 1e6, 2) == 2.63
    assert head(torch.zeros(3, 2048, dtype=torch.bfloat16)).shape == (3, 5)  # casts its input
    with pytest.raises(ValueError, match="activation"):
        heads.ScoringHead(8, activation="swish")


def test_lora_on_the_language_models_query_and_value_has_the_papers_parameter_count():
    # Appendix D: 1.61M trainable parameters in phase 2 (rank 8): LoRA on q_proj and v_proj of Qwen3-VL-2B's
    # 28 language layers. Built on the meta device: the real sizes, no memory.
    pytest.importorskip("peft")
    from transformers import AutoModelForImageTextToText, Qwen3VLConfig

    from capeval_plugins.training.phase2 import Phase2Config, add_lora

    text = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                rope_parameters=dict(rope_type="default", mrope_section=[24, 20, 20], mrope_interleaved=True,
                                     rope_theta=5e6))
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=2048,
                  deepstack_visual_indexes=[0])
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(Qwen3VLConfig(text_config=text, vision_config=vision))
    wrapped = add_lora(model, Phase2Config())
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert trainable == 28 * 8 * ((2048 + 2048) + (2048 + 1024))
    assert round(trainable / 1e6, 2) == 1.61


def test_prompts_are_the_papers_appendix_g_verbatim():
    if not PAPER.is_file():
        pytest.skip("the paper's text is not here")
    text = " ".join(PAPER.read_text().split())
    for key, prompt in paper_prompts("flat").items():
        as_printed = prompt.replace("{cand}", "cand").replace("{refs_text}", "refs_text")
        assert as_printed in text, key
        assert ("{refs_text}" in prompt) == key.endswith("_ref")
    lines = paper_prompts("lines")
    assert all(" ".join(lines[k].split("\n")) == p for k, p in paper_prompts("flat").items())
    assert lines["image"].count("\n") == 15


def test_rendering_normalises_whitespace_and_substitutes_once():
    template = paper_prompts()["image_ref"]
    out = render_prompt(template, "  a {refs_text}\n dog ", ["a  dog", "a {cand}"])
    assert "Generated Caption: a {refs_text} dog Please" in out
    assert "Reference Captions: a dog\na {cand} Generated" in out
    assert not re.search(r"\{cand\}|\{refs_text\}", out.replace("a {refs_text} dog", "").replace("a {cand}", ""))


def test_emd_needs_the_same_labels():
    with pytest.raises(ValueError, match="labels"):
        heads.emd_1d(torch.ones(5) / 5, torch.ones(4) / 4)
    assert math.isclose(float(heads.emd_1d(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0]))), 0.5)
