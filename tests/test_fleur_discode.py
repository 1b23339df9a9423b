"""FLEUR and DISCODE end to end on tiny LLaVA-NeXT judges, against a plain re-computation: transformers'
forward pass over prompt + answer (teacher forcing), then the paper's formulas in numpy and scipy."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from scipy import stats
from test_lvlm import CAPTIONS, IMAGE_OF, images, scripted_llava, sharp_llava

import capeval_plugins
from capeval_plugins.models.lvlm import SCALES, LVLMJudge, fleur_instruction

REFERENCES = [["A dog on grass."], ["Kids in a park.", "Children playing."], ["A red car."], ["A man on a bench."],
              ["A cat."], ["A dog chasing a ball."]]
ANSWERS = ["0.85", "1.0", "0.3 (out of 1.0)", "0.0", "0.07", "0.5"]


def sample_images():
    pool = images()
    return [pool[i] for i in IMAGE_OF]


@pytest.fixture
def answers(monkeypatch):
    """Make the judge answer ``answers[caption]`` (teacher forcing) instead of its own greedy answer."""
    table: dict[str, str] = {}
    real = LVLMJudge.judge

    def judge(self, images_, image_index, instructions, scale, **kwargs):
        kwargs["forced"] = [next(a for c, a in table.items() if f"Caption: {c}\n" in text) for text in instructions]
        return real(self, images_, image_index, instructions, scale, **kwargs)

    monkeypatch.setattr(LVLMJudge, "judge", judge)
    return table


LLAVA_V1 = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives "
            "helpful, detailed, and polite answers to the human's questions.")


def expand2square(image, processor):
    """LLaVA's pad: the image centred on a square of the image processor's mean colour (PIL, as LLaVA does)."""
    from PIL import Image

    background = tuple(int(x * 255) for x in processor.image_processor.image_mean)
    width, height = image.size
    side = max(width, height)
    canvas = Image.new(image.mode, (side, side), background)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


def plain_answer_distributions(path: str, image, instruction: str, answer: str, system: str | None = LLAVA_V1,
                               pad: bool = True):
    """transformers alone: softmax over the full vocabulary at every answer token (one forward pass over prompt
    + answer), and the answer's tokens as text. The official FLEUR script's conversation by default: the
    llava_v1 system sentence as a system turn, the image padded to a square."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
    if system:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
    image = expand2square(image, processor) if pad else image
    prompt = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)], images=[image],
                       return_tensors="pt")
    answer_ids = processor.tokenizer(answer, add_special_tokens=False)["input_ids"]
    ids = torch.cat([prompt["input_ids"], torch.tensor([answer_ids])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=prompt["pixel_values"],
                       image_sizes=prompt["image_sizes"]).logits[0].double()
    start = prompt["input_ids"].shape[1] - 1
    probs = torch.softmax(logits[start:start + len(answer_ids)], -1).numpy()
    pieces = [processor.tokenizer.decode([t]).strip() for t in answer_ids]
    digit_ids = [processor.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    return probs, pieces, digit_ids


def digit_steps(pieces: list[str]) -> list[int]:
    """Token index of the integer digit, first and second decimal of the first "d.dd" in the answer."""
    start = next(i for i, p in enumerate(pieces) if p.isdigit())
    assert pieces[start + 1] == "." and pieces[start + 2].isdigit()
    second = start + 3 < len(pieces) and pieces[start + 3].isdigit()
    return [start, start + 2] + ([start + 3] if second else [])


def plain_fleur(probs, pieces, digit_ids) -> float:
    steps = digit_steps(pieces)
    if pieces[steps[0]] == "1":
        return 0.9 * probs[steps[0], digit_ids[0]] + probs[steps[0], digit_ids[1]]
    score = sum(0.1 * d * probs[steps[1], digit_ids[d]] for d in range(10))
    if len(steps) > 2:
        score += sum(0.01 * d * probs[steps[2], digit_ids[d]] for d in range(10))
    return score


def plain_discode(probs, pieces, digit_ids, unit: bool, clip: bool = False) -> tuple[float, float, np.ndarray]:
    step = digit_steps(pieces)[1]
    z = np.log(probs[step, digit_ids])
    x = np.arange(10.0)
    s = int(np.argmax(z))
    log_q = -0.5 * (x - s) ** 2
    log_q -= np.log(np.exp(log_q).sum())
    on = x / 10 if unit else x
    alpha = stats.norm.pdf(on[s], on.mean(), np.sqrt(0.1))
    alpha = min(alpha, 1.0) if clip else alpha
    if alpha < 1e-30:
        psi = (np.arange(10) == np.argmax(z + log_q)).astype(float)
    else:
        e = (z + (1 - alpha) * log_q) / alpha
        psi = np.exp(e - e.max()) / np.exp(e - e.max()).sum()
    score = 0.1 * float(psi @ x)
    if pieces[digit_steps(pieces)[0]] == "1":
        score = plain_fleur(probs, pieces, digit_ids)
    return score, alpha, psi


def plain_label_head(path: str, probs, pieces, answer: str, labels, values, sigma2: float = 0.1
                     ) -> tuple[float, np.ndarray]:
    """DISCODE's default head on a one-token label scale (1-5, A-E, 0-9) from the plain forward pass: the written
    label's token, the scale's labels in the form it was written in ("B" or "▁B"), z their log-probabilities,
    q a unit-variance Gaussian on the label values around argmax z, alpha = min(1, N(k / K; mean, 0.1)) and
    psi = softmax((z + (1 - alpha) log q) / alpha). Returns (E_psi[value], psi)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    step = pieces.index(answer)  # the answer's tokens as plain_answer_distributions fed them
    written = tokenizer.convert_ids_to_tokens(tokenizer(answer, add_special_tokens=False)["input_ids"][step])
    prefix = written[: len(written) - len(answer)]
    z = np.log(probs[step, [tokenizer.convert_tokens_to_ids(prefix + label) for label in labels]])
    x = np.asarray(values, dtype=float)
    s = int(np.argmax(z))
    log_q = -0.5 * (x - x[s]) ** 2
    on = np.arange(len(x)) / len(x)
    alpha = min(stats.norm.pdf(on[s], on.mean(), np.sqrt(sigma2)), 1.0)
    e = (z + (1 - alpha) * log_q) / alpha
    psi = np.exp(e - e.max()) / np.exp(e - e.max()).sum()
    return float(psi @ x), psi


@pytest.mark.parametrize("with_references", [False, True])
def test_fleur_equals_a_plain_teacher_forced_computation(answers, with_references):
    answers.update(zip(CAPTIONS, ANSWERS))
    path = sharp_llava()
    refs = REFERENCES if with_references else None
    result = capeval_plugins.load("fleur", model=path, batch_size=4)(sample_images(), CAPTIONS, refs)
    for i, (caption, answer) in enumerate(zip(CAPTIONS, ANSWERS)):
        ins = fleur_instruction(caption, refs[i] if refs else None)
        probs, pieces, digit_ids = plain_answer_distributions(path, sample_images()[i], ins, answer)
        assert result.scores[i].item() == pytest.approx(plain_fleur(probs, pieces, digit_ids), abs=1e-6)
        first = digit_steps(pieces)[1]
        assert result.extras["digit_probs"][i].numpy() == pytest.approx(probs[first, digit_ids], abs=1e-6)
    assert result.extras["raw_score"].tolist() == [0.85, 1.0, 0.3, 0.0, 0.07, 0.5]


@pytest.mark.parametrize("alpha_scale,alpha_clip", [("label", False), ("unit", True), ("unit", False)])
def test_discode_equals_a_plain_closed_form(answers, alpha_scale, alpha_clip):
    answers.update(zip(CAPTIONS, ANSWERS))
    path = sharp_llava()
    result = capeval_plugins.load("discode", model=path, alpha_scale=alpha_scale, alpha_clip=alpha_clip)(
        sample_images(), CAPTIONS)
    fleur = capeval_plugins.load("fleur", model=path)(sample_images(), CAPTIONS)
    for i, (caption, answer) in enumerate(zip(CAPTIONS, ANSWERS)):
        probs, pieces, digit_ids = plain_answer_distributions(path, sample_images()[i], fleur_instruction(caption),
                                                              answer)
        score, alpha, psi = plain_discode(probs, pieces, digit_ids, unit=alpha_scale == "unit", clip=alpha_clip)
        assert result.scores[i].item() == pytest.approx(score, abs=1e-6)
        assert result.extras["alpha"][i].item() == pytest.approx(alpha, rel=1e-9, abs=1e-300)
        assert result.extras["distribution"][i].numpy() == pytest.approx(psi, abs=1e-5)
    assert result.extras["fleur_score"].tolist() == pytest.approx(fleur.scores.tolist(), abs=1e-12)
    assert result.extras["distribution"].shape == (6, 10)
    assert torch.allclose(result.extras["distribution"].sum(-1), torch.ones(6, dtype=torch.float64))


def test_references_switch_to_the_reference_prompt(answers, monkeypatch):
    answers.update(zip(CAPTIONS, ANSWERS))
    seen = []
    real = LVLMJudge.judge
    monkeypatch.setattr(LVLMJudge, "judge", lambda self, *a, **k: seen.append(a[2]) or real(self, *a, **k))
    metric = capeval_plugins.load("discode", model=sharp_llava())
    free = metric(sample_images(), CAPTIONS)
    with_refs = metric(sample_images(), CAPTIONS, REFERENCES)
    assert all("Reference Captions" not in t for t in seen[0])
    assert seen[1][1].endswith("Reference Captions: Kids in a park.\nChildren playing.\n\nCandidate Caption: "
                               "Two children play in the park!\n\nScore(Choose a rating from 0.0 to 1.0):")
    assert not torch.allclose(free.scores, with_refs.scores)


@pytest.mark.parametrize("scale, answer, values", [("1-5", "4", [1, 2, 3, 4, 5]), ("A-E", "B", [1, 2, 3, 4, 5]),
                                                   ("0-9", "7", list(range(10)))])
def test_discode_rating_scales(answers, monkeypatch, scale, answer, values):
    answers.update({c: answer for c in CAPTIONS})
    seen = []
    real = LVLMJudge.judge
    monkeypatch.setattr(LVLMJudge, "judge", lambda self, *a, **k: seen.append(a[2]) or real(self, *a, **k))
    path = sharp_llava()
    result = capeval_plugins.load("discode", model=path, scale=scale)(sample_images(), CAPTIONS)
    low, high = SCALES[scale].low, SCALES[scale].high
    assert f"on a scale of {low} to {high}" in seen[0][0]
    dist = result.extras["distribution"]
    assert dist.shape == (6, len(values))
    for i in (0, 3):  # the judge's own prompt, read by a plain forward pass and the head written out in numpy
        prompt = next(text for text in seen[0] if f"Caption: {CAPTIONS[i]}\n" in text)
        probs, pieces, _ = plain_answer_distributions(path, sample_images()[i], prompt, answer)
        score, psi = plain_label_head(path, probs, pieces, answer, SCALES[scale].labels, values)
        assert result.scores[i].item() == pytest.approx(score, abs=1e-6)
        assert dist[i].numpy() == pytest.approx(psi, abs=1e-6)
    assert result.extras["raw_score"].tolist() == [float(values[SCALES[scale].labels.index(answer)])] * 6


def test_what_one_point_zero_scores(answers):
    answers.update({c: "1.0" for c in CAPTIONS})
    path = sharp_llava()
    fleur_rule = capeval_plugins.load("discode", model=path, alpha_scale="unit")(sample_images(), CAPTIONS)
    decimal = capeval_plugins.load("discode", model=path, alpha_scale="unit", one_rule="decimal")
    decimal = decimal(sample_images(), CAPTIONS)
    for i in (0, 3):  # the plain forward pass: FLEUR's "1.0" rule, or 1 + the head's decimal at the "0" after "1."
        probs, pieces, digit_ids = plain_answer_distributions(path, sample_images()[i], fleur_instruction(CAPTIONS[i]),
                                                              "1.0")
        _, _, psi = plain_discode(probs, pieces, digit_ids, unit=True, clip=True)
        assert fleur_rule.scores[i].item() == pytest.approx(plain_fleur(probs, pieces, digit_ids), abs=1e-6)
        assert decimal.scores[i].item() == pytest.approx(1 + 0.1 * psi @ np.arange(10.0), abs=1e-6)


def test_numeric_solvers_at_the_metric_level(answers):
    answers.update(zip(CAPTIONS, ANSWERS))
    path = sharp_llava()
    closed = capeval_plugins.load("discode", model=path, alpha_scale="unit")(sample_images(), CAPTIONS)
    converged = capeval_plugins.load("discode", model=path, alpha_scale="unit", solver="converge")
    converged = converged(sample_images(), CAPTIONS)
    assert torch.allclose(converged.extras["distribution"], closed.extras["distribution"], atol=1e-7)
    paper = capeval_plugins.load("discode", model=path, alpha_scale="unit", solver="adam")(sample_images(), CAPTIONS)
    assert not torch.allclose(paper.scores, closed.scores)
    for divergence in ("renyi", "beta", "js"):
        other = capeval_plugins.load("discode", model=path, divergence=divergence)(sample_images(), CAPTIONS)
        assert torch.isfinite(other.scores).all() and "alpha" not in other.extras
        assert torch.allclose(other.extras["distribution"].sum(-1), torch.ones(6, dtype=torch.float64))
    with pytest.raises(ValueError, match="no closed form"):
        capeval_plugins.load("discode", model=path, divergence="js", solver="closed_form")
    with pytest.raises(ValueError, match="alpha_scale"):
        capeval_plugins.load("discode", model=path, alpha_scale="digits")


def test_answers_without_a_score_get_nan_and_a_warning_or_raise(answers):
    path = sharp_llava()
    answers.update(zip(CAPTIONS, ANSWERS))
    valid = capeval_plugins.load("discode", model=path)(sample_images(), CAPTIONS)
    answers.update({CAPTIONS[2]: "The caption is fine.", CAPTIONS[4]: "1.5"})
    with pytest.warns(UserWarning, match=r"sample 2: no number.*sample 4: '1.5'"):
        mixed = capeval_plugins.load("discode", model=path)(sample_images(), CAPTIONS)
    assert torch.isnan(mixed.scores[[2, 4]]).all() and mixed.corpus_extras["n_invalid"] == 2
    keep = [0, 1, 3, 5]
    assert mixed.scores[keep].tolist() == pytest.approx(valid.scores[keep].tolist(), abs=1e-6)  # nothing misaligned
    assert mixed.score == pytest.approx(float(valid.scores[keep].mean()), abs=1e-6)
    with pytest.raises(ValueError, match=r"sample 2: no number"):
        capeval_plugins.load("fleur", model=path, on_invalid="raise")(sample_images(), CAPTIONS)


def test_greedy_judges_through_torchmetrics_and_evaluate():
    """No forcing: a judge that writes "0.8A" greedily, scored through two ecosystems."""
    import evaluate

    from capeval_plugins.torchmetrics import DISCODE

    path = scripted_llava(("▁[/INST]", "▁", "0", ".", "8", "A", "▁dog"))
    imgs = sample_images()
    direct = capeval_plugins.load("discode", model=path)(imgs, CAPTIONS, REFERENCES)
    assert direct.extras["raw_score"].tolist() == [0.8] * 6 and torch.isfinite(direct.scores).all()
    tm = DISCODE(model=path)
    tm.update(imgs[:2], CAPTIONS[:2], REFERENCES[:2])
    tm.update(imgs[2:], CAPTIONS[2:], REFERENCES[2:])
    both = tm.compute_all()
    assert both.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-9)
    assert torch.allclose(both.extras["distribution"], direct.extras["distribution"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = evaluate.load("fleur", model=path).compute(images=imgs, predictions=CAPTIONS)
    fleur = capeval_plugins.load("fleur", model=path)(imgs, CAPTIONS)
    assert out["scores"] == pytest.approx(fleur.scores.tolist(), abs=1e-9)
    assert out["raw_score"] == [0.8] * 6


def test_conversation_options_reach_the_judge(answers):
    """The official script's conversation (llava_v1 system sentence, padded image) is the default and is what the
    plain computation above uses; without them the judge sees a bare user turn and the cropped image."""
    answers.update(zip(CAPTIONS, ANSWERS))
    path = sharp_llava()
    bare = capeval_plugins.load("fleur", model=path, system_prompt=None, image_aspect="crop")(sample_images(), CAPTIONS)
    default = capeval_plugins.load("fleur", model=path)(sample_images(), CAPTIONS)
    for i in (0, 2):
        probs, pieces, digit_ids = plain_answer_distributions(path, sample_images()[i], fleur_instruction(CAPTIONS[i]),
                                                              ANSWERS[i], system=None, pad=False)
        assert bare.scores[i].item() == pytest.approx(plain_fleur(probs, pieces, digit_ids), abs=1e-6)
    assert (bare.scores - default.scores).abs().max() > 1e-4
    user_turn = capeval_plugins.load("fleur", model=path, system_placement="user")(sample_images(), CAPTIONS)
    assert (user_turn.scores - default.scores).abs().max() > 1e-4
    with pytest.raises(ValueError, match="image_aspect"):
        capeval_plugins.load("fleur", model=path, image_aspect="stretch")
    with pytest.raises(ValueError, match="system_placement"):
        capeval_plugins.load("discode", model=path, system_placement="first")


def test_a_written_trailing_zero_is_smoothed_unless_dropped_as_the_official_script_does(answers):
    answers.update({c: "0.50" for c in CAPTIONS})
    path = sharp_llava()
    smooth = capeval_plugins.load("fleur", model=path)(sample_images(), CAPTIONS)
    dropped = capeval_plugins.load("fleur", model=path, trailing_zero="drop")(sample_images(), CAPTIONS)
    i = 1
    probs, pieces, digit_ids = plain_answer_distributions(path, sample_images()[i], fleur_instruction(CAPTIONS[i]),
                                                          "0.50")
    first, second = digit_steps(pieces)[1:]
    tenths = sum(0.1 * d * probs[first, digit_ids[d]] for d in range(10))
    hundredths = sum(0.01 * d * probs[second, digit_ids[d]] for d in range(10))
    assert smooth.scores[i].item() == pytest.approx(tenths + hundredths, abs=1e-6)
    assert dropped.scores[i].item() == pytest.approx(tenths, abs=1e-6)  # float("0.50") -> "0.5" in the script
    assert hundredths > 1e-4
    answers.update({c: "0.57" for c in CAPTIONS})  # other second digits are smoothed either way
    both = [capeval_plugins.load("fleur", model=path, trailing_zero=t)(sample_images(), CAPTIONS) for t in
            ("smooth", "drop")]
    assert both[0].scores.tolist() == both[1].scores.tolist()
    with pytest.raises(ValueError, match="trailing_zero"):
        capeval_plugins.load("fleur", model=path, trailing_zero="keep")


def test_one_point_zero_answers_say_their_score_is_not_the_heads(answers):
    answers.update(zip(CAPTIONS, ANSWERS))  # sample 1 answers "1.0"
    path = sharp_llava()
    fleur_rule = capeval_plugins.load("discode", model=path, alpha_scale="unit")(sample_images(), CAPTIONS)
    assert fleur_rule.extras["from_att_head"].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    # the head's score where it gives one, FLEUR's rule for "1.0": each against the plain forward pass; alpha and
    # the distribution are the head's at the paper's target, the "0" after "1.", for every answer
    for i in (0, 1, 2):
        probs, pieces, digit_ids = plain_answer_distributions(path, sample_images()[i], fleur_instruction(CAPTIONS[i]),
                                                              ANSWERS[i])
        score, _, psi = plain_discode(probs, pieces, digit_ids, unit=True, clip=True)
        assert fleur_rule.scores[i].item() == pytest.approx(score, abs=1e-6)
        assert fleur_rule.extras["distribution"][i].numpy() == pytest.approx(psi, abs=1e-6)
    decimal = capeval_plugins.load("discode", model=path, alpha_scale="unit", one_rule="decimal")(sample_images(),
                                                                                                    CAPTIONS)
    assert decimal.extras["from_att_head"].tolist() == [1.0] * 6
    assert torch.equal(decimal.extras["distribution"], fleur_rule.extras["distribution"])


def test_judge_precision_defaults():
    """float16 on GPUs for FLEUR (the official script's), bfloat16 for DISCODE, float32 on CPU; dtype overrides.
    Only the spec is built: nothing is loaded."""
    path = sharp_llava()
    spec = lambda name, **kw: capeval_plugins.load(name, model=path, **kw).judge_spec().dtype  # noqa: E731
    assert spec("fleur", device="cuda") == "float16" and spec("discode", device="cuda") == "bfloat16"
    assert spec("fleur", device="cpu") is None and spec("discode", device="cpu") is None
    assert spec("fleur", device="cuda", dtype="bfloat16") == "bfloat16"


# --- issue 19: the default reading of Eq. 4 adapts the written digit; Table 10's ablations -----------------


def test_default_adapts_typical_answers_and_the_literal_reading_returns_the_written_digit(answers):
    answers.update(zip(CAPTIONS, ANSWERS))
    path = sharp_llava()
    default = capeval_plugins.load("discode", model=path)(sample_images(), CAPTIONS)
    literal = capeval_plugins.load("discode", model=path, alpha_scale="label")(sample_images(), CAPTIONS)
    for psi, alpha in zip(default.extras["distribution"], default.extras["alpha"]):
        assert 0.4 < alpha.item() <= 1.0
        assert psi.max().item() < 0.99 and int((psi > 1e-3).sum()) >= 2  # spread over several digits
    # The literal reading: every row here has its raw digit outside {4, 5}, alpha < 2e-5 and psi one-hot.
    for psi, alpha in zip(literal.extras["distribution"], literal.extras["alpha"]):
        assert alpha.item() < 2e-5
        assert psi.max().item() == 1.0 and int((psi > 0).sum()) == 1


@pytest.mark.parametrize("scale", ["0.0-1.0", "1-5", "0-9", "A-E"])
def test_default_alpha_of_every_label_is_in_the_papers_range(scale):
    """Every written label of every scale, at every sigma^2 of Table 11: alpha in [0, 1], largest near mu."""
    for sigma2 in (1.0, 0.5, 0.1, 0.05, 0.01):
        alphas = capeval_plugins.load("discode", model="unused", scale=scale, sigma2=sigma2).alphas.numpy()
        k = len(alphas)
        on = np.arange(k) / k
        np.testing.assert_allclose(alphas, np.minimum(1.0, stats.norm.pdf(on, on.mean(), np.sqrt(sigma2))),
                                   rtol=1e-12)
        assert np.all((0 <= alphas) & (alphas <= 1)) and np.all(np.diff(alphas[: (k + 1) // 2]) >= -1e-15)


@pytest.mark.parametrize("raw_digit", range(10))
def test_default_head_is_not_one_hot_for_any_written_digit(raw_digit):
    from capeval_plugins import functional as F

    # A distribution like LLaVA's at the first decimal (paper Fig. 4): the written digit plus mass elsewhere.
    p = np.full(10, 0.02)
    p[raw_digit] = 0.6
    p[min(raw_digit + 1, 9) if raw_digit != 9 else 8] += 0.15
    logits = torch.tensor(np.log(p / p.sum()))[None]
    default = F.discode_head(logits).distribution[0]
    literal = F.discode_head(logits, alpha_scale="label").distribution[0]
    assert int((default > 1e-3).sum()) >= 2
    assert (int((literal > 0).sum()) == 1) == (raw_digit not in (4, 5))


def numpy_ablation(z: np.ndarray, alpha: float, ablation: str) -> np.ndarray:
    """The ablated losses' minimisers written out (Lagrange conditions on the simplex), numpy."""
    x = np.arange(10.0)
    s = int(np.argmax(z))
    log_q = -0.5 * (x - s) ** 2
    if ablation == "no_divergence":  # linear in psi: all mass on the largest p
        return (z == z.max()).astype(float)
    if ablation == "no_cross_entropy":  # (1 - a) H(psi, q) - a H(psi): psi proportional to q^((1 - a) / a)
        e = (1 - alpha) / alpha * log_q
    else:  # fixed alpha = 0.5: psi proportional to p^2 q
        e = 2 * z + log_q
    e = np.exp(e - e.max())
    return e / e.sum()


@pytest.mark.parametrize("ablation", ["no_cross_entropy", "no_divergence", "fixed_alpha"])
def test_table10_ablations_equal_their_closed_forms(answers, ablation):
    answers.update(zip(CAPTIONS, ANSWERS))
    path = sharp_llava()
    result = capeval_plugins.load("discode", model=path, ablation=ablation)(sample_images(), CAPTIONS)
    fleur = capeval_plugins.load("fleur", model=path)(sample_images(), CAPTIONS)
    x = np.arange(10.0)
    for i in range(len(CAPTIONS)):
        z = np.log(fleur.extras["digit_probs"][i].numpy())  # the digit distribution at the first decimal
        on = x / 10
        alpha = stats.norm.pdf(on[int(np.argmax(z))], on.mean(), np.sqrt(0.1))
        psi = numpy_ablation(z, alpha, ablation)
        assert result.extras["distribution"][i].numpy() == pytest.approx(psi, abs=1e-6)
        if ANSWERS[i] != "1.0":
            assert result.scores[i].item() == pytest.approx(0.1 * psi @ x, abs=1e-6)
    assert ("alpha" in result.extras) == (ablation != "no_divergence")
    with pytest.raises(ValueError, match="ablation"):
        capeval_plugins.load("discode", model=path, ablation="no_prior")
    with pytest.raises(ValueError, match="weighted_kl"):
        capeval_plugins.load("discode", model=path, ablation=ablation, divergence="js")


@pytest.mark.parametrize("name", ["fleur", "discode"])
def test_the_card_lists_the_keys_of_a_result(name):
    """The keys a card's example shows are those evaluate returns, ``n_invalid`` among them even when every
    answer had a valid score (a judge's results have the same keys whatever it answered)."""
    import ast
    import re

    import evaluate

    from capeval_plugins.cards import card_path

    text = card_path(name).read_text()
    full = re.search(r">>> sorted\(out\)\n(\[.*?\])", text)  # every key, or a subset `{...} <= set(out)`
    listed = ast.literal_eval(full.group(1) if full else re.search(r">>> (\{.*?\}) <= set\(out\)\nTrue", text).group(1))
    path = scripted_llava(("▁[/INST]", "▁", "0", ".", "8", "A", "▁dog"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = evaluate.load(name, model=path).compute(images=sample_images()[:2], predictions=CAPTIONS[:2])
    assert out["n_invalid"] == 0 and (sorted(out) == listed if full else set(listed) <= set(out))


def test_fleur_and_discode_in_one_pass_ask_the_judge_once():
    """``-m fleur -m discode`` on one judge: the same prompts about the same images are answered once (the
    judge ran twice before), and each metric's scores are those it gets alone."""
    from capeval_plugins import runner

    path = scripted_llava(("▁[/INST]", "▁", "0", ".", "8", "A", "▁dog"))
    imgs = sample_images()
    judge = LVLMJudge.shared(capeval_plugins.load("fleur", model=path).judge_spec())
    chunks = []
    real_chunk = judge._run_chunk
    judge._run_chunk = lambda run, rows, table: (chunks.append(len(rows)), real_chunk(run, rows, table))[1]
    try:
        alone = {}
        for name in ("fleur", "discode"):
            judge.results.clear()
            alone[name] = runner.score(capeval_plugins.load(name, model=path), imgs, CAPTIONS, REFERENCES)
        runs_alone = sum(chunks)
        judge.results.clear()
        chunks.clear()
        both = runner.score_many({name: capeval_plugins.load(name, model=path) for name in ("fleur", "discode")},
                                 imgs, CAPTIONS, REFERENCES)
        assert sum(chunks) == runs_alone // 2 == len(CAPTIONS)
        for name in alone:
            assert both[name].scores.tolist() == alone[name].scores.tolist()
        # a different question (another caption) is asked again, never answered from the kept ones
        chunks.clear()
        other = runner.score(capeval_plugins.load("fleur", model=path), imgs, ["A blue car."] + CAPTIONS[1:],
                             REFERENCES)
        assert sum(chunks) == len(CAPTIONS) and other.scores.shape == alone["fleur"].scores.shape
    finally:
        del judge._run_chunk
