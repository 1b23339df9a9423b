"""FLEUR (and DISCODE) on LLaVA-1.5 read at the official script's token level (Yebin46/FLEUR ``fleur.py`` and
``reffleur.py``, with LLaVA at the commit its submodule pins).

The script loads ``liuhaotian/llava-v1.5-13b`` through LLaVA's own code: the prompt is LLaVA's ``llava_v1``
conversation, turned into ids by ``tokenizer_image_token`` (the text on each side of ``<image>`` tokenised on its
own by the slow SentencePiece tokenizer, so the text after the image starts with the dummy-prefix piece "▁", which
the llava-hf chat template's one-string tokenisation does not write), and its LM head has the 32,000 rows of the
Llama 2 vocabulary: the greedy token and the softmax of ``output_dict.scores`` range over them, where the
transformers conversion ``llava-hf/llava-1.5-13b-hf`` has 32,064 rows (``<image>``, ``<pad>`` and padding to a
multiple of 64, sampled around the mean input embedding by the conversion script).

The reference here is computed without the code under test: LLaVA's conversation and ``tokenizer_image_token``
ported in this file over SentencePiece itself (the slow tokenizer LLaVA loads with ``use_fast=False``), one sample
at a time, no cache, greedy over the first 32,000 logits, and the script's scoring block ported line by line
(float64 softmax; the models run in float64 on both sides, so the tolerance 1e-6 is far above rounding). The judge
is a tiny LLaVA-1.5 around the real Llama 2 tokenizer, its extra rows added as the conversion adds them, its head
scripted so that greedy decoding writes a chosen answer while the digit distributions stay soft and depend on the
image and the caption (tests/test_expert.py). Skipped where the Llama 2 tokenizer file is absent.
"""
from __future__ import annotations

import dataclasses
import math
import re
from functools import lru_cache

import numpy as np
import pytest
import torch
from conftest import random_image
from test_expert import TOKENIZERS, llama2_tokenizer, scripted_llava15

import capeval_plugins
from capeval_plugins.inputs import InputError
from capeval_plugins.testing import scratch_folder
from capeval_plugins.testing.official_code import expand2square

BOS, EOS = 1, 2
IMAGE_TOKEN_INDEX = -200  # LLaVA's constants.IMAGE_TOKEN_INDEX, replaced by the image features in the model
SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives helpful, "
          "detailed, and polite answers to the human's questions.")
BASE_ROWS = 32000  # liuhaotian/llava-v1.5-13b: vocab_size 32000, no token added by LLaVA's builder


# --- the official script's side, ported ------------------------------------------------------------------------


@lru_cache(maxsize=None)
def sentencepiece():
    spm = pytest.importorskip("sentencepiece")
    llama2_tokenizer()  # skips where the tokenizer file is absent
    return spm.SentencePieceProcessor(model_file=str(TOKENIZERS / "llama2" / "tokenizer.model"))


def llava_v1_prompt(message: str, system: str = SYSTEM) -> str:
    """``conv_templates["llava_v1"]`` after ``append_message(USER, "<image>\\n" + inp)``,
    ``append_message(ASSISTANT, None)``: ``get_prompt()`` of the TWO separator style."""
    messages = [("USER", "<image>\n" + message), ("ASSISTANT", None)]
    seps = [" ", "</s>"]
    ret = system + seps[0]
    for i, (role, text) in enumerate(messages):
        ret += role + ": " + text + seps[i % 2] if text else role + ":"
    return ret


def tokenizer_image_token(prompt: str, sp) -> list[int]:
    """llava/mm_utils.py's function, ``tokenizer(chunk).input_ids`` being the slow Llama tokenizer's: the BOS, then
    SentencePiece's pieces of the chunk."""
    prompt_chunks = [[BOS] + sp.encode(chunk) for chunk in prompt.split("<image>")]
    input_ids, offset = [], 0
    if prompt_chunks and prompt_chunks[0] and prompt_chunks[0][0] == BOS:
        offset = 1
        input_ids.append(prompt_chunks[0][0])
    separated = [e for pair in zip(prompt_chunks, [[IMAGE_TOKEN_INDEX] * (offset + 1)] * len(prompt_chunks))
                 for e in pair][:-1]
    for x in separated:
        input_ids.extend(x[offset:])
    return input_ids


def fleur_prompt(candidate: str) -> str:
    return ("Your task is to evaluate and rate the caption on a scale of 0.0 to 1.0 based on the given Grading "
            "Criteria. (Print Real Number Score ONLY)\n\nGrading Criteria:\n\n0.0: The caption does not describe the "
            "image at all.\n1.0: The caption accurately and clearly describes the image.\n\n"
            f"Caption: {' '.join(candidate.split())}\n\nScore(Choose a rating from 0.0 to 1.0):")


def reffleur_prompt(candidate: str, references: list[str]) -> str:
    return ("Your task is to evaluate and rate the candidate caption on a scale of 0.0 to 1.0 based on the given "
            "Grading Criteria. (Print Real Number Score ONLY)\n\nGrading Criteria:\n\n0.0: The caption does not "
            "describe the image at all.\n1.0: The caption accurately and clearly describes the image.\n\n"
            f"Reference Captions: {chr(10).join(references)}\n\nCandidate Caption: {' '.join(candidate.split())}"
            "\n\nScore(Choose a rating from 0.0 to 1.0):")


def script_score(outputs: str, answer: torch.Tensor, scores: list[torch.Tensor], rate2token: dict) -> float | None:
    """fleur.py's block after ``generate`` (``answer`` = ``output_ids[0, input_ids.shape[1]:]``, ``scores`` the
    logits of each step); None where the script prints "Error!" or skips the sample."""
    try:
        dotsnumbersdots = re.sub(r'[^\d\.]', '', outputs[:-4])
        numbersdots = re.sub(r'^\.+', '', dotsnumbersdots)
        numbers = re.sub(r'\.+$', '', numbersdots)
        score_check = float(numbers)
        if 0 > score_check or 1 < score_check:
            return None
        if score_check < 1.0:
            num_index_in_score = str(score_check).index('.') + 1
            find_num = int(str(score_check)[num_index_in_score])
            num_index_in_token = (answer == rate2token[find_num]).nonzero().squeeze()
            if len(num_index_in_token.shape) > 0:
                num_index_in_token = num_index_in_token[1] if find_num == 0 else num_index_in_token[0]
            probs = torch.nn.functional.softmax(scores[num_index_in_token], dim=-1)
            score = 0.
            for rate, token in rate2token.items():
                score += probs[token] * rate * 0.1
            if len(str(score_check)) > 3:
                find_num2 = int(str(score_check)[str(score_check).index('.') + 2])
                num2_index_in_token = (answer == rate2token[find_num2]).nonzero().squeeze()
                if len(num2_index_in_token.shape) > 0:
                    num2_index_in_token = num2_index_in_token[1]
                probs2 = torch.nn.functional.softmax(scores[num2_index_in_token], dim=-1)
                for rate, token in rate2token.items():
                    score += probs2[token] * rate * 0.01
        else:
            num_index_in_token = (answer == rate2token[1]).nonzero().squeeze()
            probs = torch.nn.functional.softmax(scores[num_index_in_token], dim=-1)
            score = 0.9 * probs[rate2token[0]] + probs[rate2token[1]]
        return float(score)
    except (ValueError, IndexError, TypeError):
        return None


def script_run(path: str, images, prompts: list[str], max_new_tokens: int = 12):
    """The script's loop: per sample, the prompt's ids, greedy decoding over the first 32,000 logits (one forward
    pass over the whole sequence per step), the answer and its score; also the digit distributions at every step."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    sp = sentencepiece()
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float64).eval()
    processor = AutoProcessor.from_pretrained(path)
    image_id = model.config.image_token_index
    rate2token = {s: sp.encode(str(s))[-1] for s in range(10)}  # tokenizer.encode(str(s))[-1]
    mean = tuple(int(x * 255) for x in processor.image_processor.image_mean)
    out = []
    for image, prompt in zip(images, prompts):
        ids = tokenizer_image_token(prompt, sp)
        pixels = processor.image_processor(expand2square(image, mean), return_tensors="pt")["pixel_values"]
        n_image = int((processor(text=["<image>"], images=[image], return_tensors="pt")["input_ids"] == image_id).sum())
        at = ids.index(IMAGE_TOKEN_INDEX)
        expanded = ids[:at] + [image_id] * n_image + ids[at + 1:]
        answer, scores = [], []
        for _ in range(max_new_tokens):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([expanded + answer]), pixel_values=pixels.double()).logits[0, -1]
            scores.append(logits[:BASE_ROWS])
            answer.append(int(scores[-1].argmax()))
            if answer[-1] == EOS:
                break
        text = sp.decode([t for t in answer if t != EOS]) + ("</s>" if answer[-1] == EOS else "")
        score = script_score(text.strip(), torch.tensor(answer), scores, rate2token)
        out.append((score, text, ids))
    return out


# --- the judge: a tiny LLaVA-1.5, the conversion's extra rows ---------------------------------------------------

SCORE_075 = (":", "▁", "0", ".", "7", "5", "</s>")
SCORE_10 = (":", "▁", "1", ".", "0", "</s>")
SOFT = (("▁", 4.0), (".", 6.0), ("7", 6.0))  # as tests/test_expert.py: the same judges


@lru_cache(maxsize=None)
def converted_llava15(chain: tuple[str, ...], soft: tuple[tuple[str, float], ...] = SOFT) -> str:
    """:func:`test_expert.scripted_llava15` with its rows past the 32,000 of Llama 2 (``<image>``, ``<pad>``, padding
    to 32,064) drawn as transformers' ``convert_llava_weights_to_hf.py`` draws them, for the input embeddings and
    the LM head alike: from a normal around the mean of the 32,000 input embeddings, covariance 1e-5 times theirs."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    src = scripted_llava15(chain, soft)
    model = LlavaForConditionalGeneration.from_pretrained(src)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        base = embed[:BASE_ROWS].double()
        mu = base.mean(0)
        sigma = (base - mu).T @ (base - mu) / BASE_ROWS
        dist = torch.distributions.MultivariateNormal(mu, covariance_matrix=1e-5 * sigma)
        torch.manual_seed(0)
        for matrix in (embed, model.get_output_embeddings().weight):
            matrix[BASE_ROWS:] = dist.sample((matrix.shape[0] - BASE_ROWS,)).float()
    path = scratch_folder("capeval-fleur-llava15-")
    model.save_pretrained(path)
    AutoProcessor.from_pretrained(src).save_pretrained(path)
    return str(path)


CAPTIONS = ["A dog runs on the grass.", "two  men playing soccer", "A red car.", "",
            "Ünïcode café — «quotes» 123"]
REFERENCES = [["A dog on a lawn."], ["Men play football.", "A soccer game."], ["A car."], ["Something."],
              ["A café sign."]]


def corpus():
    images = [random_image(60 + i, size=(40 + 6 * i, 30 + 2 * i)) for i in range(3)]
    index = [0, 0, 1, 2, 2]
    return [images[i] for i in index], CAPTIONS


def fleur(path: str, **options):
    return capeval_plugins.load("fleur", model=path, device="cpu", dtype="float64", batch_size=3, **options)


# --- tests ----------------------------------------------------------------------------------------------------


def test_the_prompt_ids_are_llavas_tokenizer_image_token_over_sentencepiece():
    """FLEUR's and RefFLEUR's prompts: the judge's ids are those of the official script (one "▁" more after the
    image than the chat template's, everything else equal)."""
    from capeval_plugins.models.lvlm import JudgeSpec, LVLMJudge, fleur_instruction

    sp = sentencepiece()
    judge = LVLMJudge.shared(JudgeSpec(converted_llava15(SCORE_075), device="cpu", dtype="float32"))
    metric = fleur(converted_llava15(SCORE_075))
    assert metric.reading(judge) == ("llava", BASE_ROWS)
    for caption, refs in zip(CAPTIONS, REFERENCES):
        for ours, official in ((fleur_instruction(caption), fleur_prompt(caption)),
                               (fleur_instruction(caption, refs), reffleur_prompt(caption, refs))):
            prompt = llava_v1_prompt(official)
            want = [judge.image_token_id if t == IMAGE_TOKEN_INDEX else t for t in tokenizer_image_token(prompt, sp)]
            assert judge._llava_ids(metric.llava_prompts([ours], _batch([caption], [refs]))[0]) == want
            chat = judge.tokenizer(judge.chat(ours, random_image(0), metric.visual_input))["input_ids"]
            at = want.index(judge.image_token_id)
            assert want[at + 1] == sp.piece_to_id("▁") and chat == want[:at + 1] + want[at + 2:]


def _batch(candidates, references=None):
    from capeval_plugins.contract import Batch

    return Batch(candidates=list(candidates), indices=torch.arange(len(candidates)), images=[random_image(0)],
                 image_index=torch.zeros(len(candidates), dtype=torch.long), references=references)


@pytest.mark.parametrize("chain", [SCORE_075, SCORE_10])
@pytest.mark.parametrize("with_references", [False, True])
def test_default_fleur_on_llava15_equals_the_official_script(chain, with_references):
    """Per sample, FLEUR's default equals the script's score (answers '0.75' and '1.0' whose digit distributions
    differ by image and caption); RefFLEUR equals reffleur.py's. Both sides run the model in float64 and agree to
    about 1e-8 (the judge keeps label log-probabilities in float32), a hundredth of the tolerance; the former
    default (chat template, every row) is 3e-4 to 1.2e-3 away on these samples."""
    path = converted_llava15(chain)
    images, captions = corpus()
    refs = REFERENCES if with_references else None
    prompts = [llava_v1_prompt(reffleur_prompt(c, r) if refs else fleur_prompt(c))
               for c, r in zip(captions, refs or [None] * len(captions))]
    want = script_run(path, images, prompts)
    assert all(w[0] is not None for w in want)
    result = fleur(path)(images, captions, refs)
    np.testing.assert_allclose(result.scores.numpy(), [w[0] for w in want], rtol=0, atol=1e-6)
    assert len(set(np.round(result.scores.numpy(), 5))) > 2  # the distributions differ by image and caption
    assert result.extras["raw_score"].tolist() == [float("".join(chain[2:-1]))] * len(captions)


def chat_template_fleur(path: str, image, instruction: str) -> float:
    """The former reading, with transformers alone: the llava-hf chat template (the llava_v1 sentence as its system
    turn), the padded image, the answer "▁0.75" teacher-forced, softmax over every row at its two decimals."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float64).eval()
    messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
    mean = tuple(int(x * 255) for x in processor.image_processor.image_mean)
    enc = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)],
                    images=[expand2square(image, mean)], return_tensors="pt")
    answer = processor.tokenizer.convert_tokens_to_ids(["▁", "0", ".", "7", "5"])
    ids = torch.cat([enc["input_ids"], torch.tensor([answer])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=enc["pixel_values"].double()).logits[0]
    probs = torch.softmax(logits[-3:-1], -1)  # the steps that wrote "7" and "5"
    digits = processor.tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    return float(sum(0.1 * d * probs[0, t] + 0.01 * d * probs[1, t] for d, t in enumerate(digits)))


def test_the_chat_template_and_full_vocabulary_readings_are_named_options():
    """template='chat' is the former default: the llava-hf chat template over all 32,064 rows (equal to a plain
    transformers computation of it); vocabulary='full' keeps LLaVA's tokenisation but takes every row. Each
    differs from the official reading by more than float rounding."""
    from capeval_plugins.models.lvlm import fleur_instruction

    path = converted_llava15(SCORE_075)
    images, captions = corpus()
    official = fleur(path)(images, captions).scores
    chat = fleur(path, template="chat")(images, captions).scores
    full = fleur(path, vocabulary="full")(images, captions).scores
    chat_base = fleur(path, template="chat", vocabulary="base")(images, captions).scores
    for i in (0, 2):
        assert chat[i].item() == pytest.approx(chat_template_fleur(path, images[i], fleur_instruction(captions[i])),
                                               abs=1e-6)
    for other in (chat, full, chat_base):
        assert (other - official).abs().min() > 1e-5
    assert (full < official).all()  # the same logits, 64 more rows in the softmax's sum
    assert (chat_base - official).abs().max() > 1e-4  # the "▁" after the image alone


def test_options_are_checked_and_auto_follows_the_checkpoint():
    from test_lvlm import sharp_llava

    from capeval_plugins.models.lvlm import JudgeSpec, LVLMJudge

    path = converted_llava15(SCORE_075)
    for options, word in (({"template": "jinja"}, "template"), ({"vocabulary": "all"}, "vocabulary"),
                          ({"template": "llava", "system_placement": "user"}, "system_placement")):
        with pytest.raises(ValueError, match=word):
            fleur(path, **options)
    judge = LVLMJudge.shared(JudgeSpec(path, device="cpu", dtype="float32"))
    assert fleur(path, system_placement="user").reading(judge) == ("chat", None)  # a placement asks for a template
    assert fleur(path, template="chat", vocabulary="base").reading(judge) == ("chat", BASE_ROWS)
    next_judge = LVLMJudge.shared(JudgeSpec(sharp_llava(), device="cpu", dtype="float32"))
    assert not next_judge.is_llava15 and fleur(sharp_llava()).reading(next_judge) == ("chat", None)
    assert capeval_plugins.load("discode", model=path).reading(judge) == ("llava", BASE_ROWS)


def test_a_caption_holding_the_image_placeholder_is_that_samples_error():
    """LLaVA's conversation cannot carry "<image>" in a caption: that sample is refused (skipped under
    on_error='skip'), the others are scored as alone."""
    path = converted_llava15(SCORE_075)
    images, captions = corpus()
    bad = list(captions)
    bad[1] = "a dog <image> on grass"
    skipped = fleur(path, on_error="skip")(images, bad)
    assert math.isnan(skipped.scores[1].item()) and "placeholder" in skipped.skipped[1]
    alone = fleur(path)(images[:1] + images[2:], captions[:1] + captions[2:])
    np.testing.assert_allclose(np.delete(skipped.scores.numpy(), 1), alone.scores.numpy(), rtol=0, atol=1e-6)
    with pytest.raises(InputError, match="sample 1.*placeholder"):
        fleur(path)(images, bad)


def test_every_entry_point_gets_the_official_reading_and_its_options(tmp_path):
    """evaluate and torchmetrics give the metric's own numbers, default and named option alike (the options are
    ordinary keyword arguments; the command line parses them as strings)."""
    import evaluate

    from capeval_plugins.options import parse_value
    from capeval_plugins.torchmetrics import FLEUR as TorchFLEUR

    path = converted_llava15(SCORE_075)
    images, captions = corpus()
    paths = []
    for k, image in enumerate(images):
        image.save(tmp_path / f"{k}.png")
        paths.append(str(tmp_path / f"{k}.png"))
    for options in ({}, {"template": "chat"}):
        direct = fleur(path, **options)(paths, captions).scores.tolist()
        out = evaluate.load("fleur", model=path, device="cpu", dtype="float64", **options).compute(
            images=paths, predictions=captions)
        assert out["scores"] == pytest.approx(direct, abs=1e-9)
        metric = TorchFLEUR(model=path, device="cpu", dtype="float64", **options)
        metric.update(paths[:2], captions[:2])
        metric.update(paths[2:], captions[2:])
        assert metric.compute_all().scores.tolist() == pytest.approx(direct, abs=1e-9)
    fields = {f.name: f for f in dataclasses.fields(type(fleur(path).config))}
    assert [parse_value("fleur", k, v, fields[k]) for k, v in (("template", "chat"), ("vocabulary", "base"))] == \
        ["chat", "base"]


# A softer first decimal for DISCODE's head (about 0.77 on "7", 0.22 on "9" after its test-time adaptation)
WIDE = (("▁", 4.0), (".", 36.0), ("7", 6.0))


def test_discode_on_llava15_reads_the_official_distributions():
    """DISCODE on the same judge asks FLEUR's question the same way (its conversation is FLEUR's script's): its
    closed form on the official digit distribution (first decimal, 32,000-row softmax, LLaVA's tokenisation)."""
    from test_fleur_discode import plain_discode
    from transformers import LlavaForConditionalGeneration

    path = converted_llava15(SCORE_075, WIDE)
    images, captions = corpus()
    sp = sentencepiece()
    digit_ids = [sp.encode(str(d))[-1] for d in range(10)]
    discode = capeval_plugins.load("discode", model=path, device="cpu", dtype="float64")
    result = discode(images, captions)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float64).eval()
    for i, (image, caption) in enumerate(zip(images, captions)):
        probs = np.zeros((3, BASE_ROWS))  # the answer's steps "0", ".", "7": the head reads the third
        probs[2] = official_step_probs(model, path, image, llava_v1_prompt(fleur_prompt(caption)), ["0", "."])
        want, _, psi = plain_discode(probs, ["0", ".", "7"], digit_ids, unit=True, clip=True)
        assert result.scores[i].item() == pytest.approx(want, abs=1e-6)
        assert 0.1 < psi[9] < 0.5  # a soft distribution: the head's expectation moves with it
    chat = capeval_plugins.load("discode", model=path, device="cpu", dtype="float64", template="chat")
    assert (chat(images, captions).scores - result.scores).abs().max() > 1e-5


def official_step_probs(model, path: str, image, prompt: str, written: list[str]) -> np.ndarray:
    """The 32,000-row softmax after the prompt and the answer's first tokens ``written`` ("▁" first)."""
    from transformers import AutoProcessor

    sp = sentencepiece()
    processor = AutoProcessor.from_pretrained(path)
    ids = tokenizer_image_token(prompt, sp)
    mean = tuple(int(x * 255) for x in processor.image_processor.image_mean)
    pixels = processor.image_processor(expand2square(image, mean), return_tensors="pt")["pixel_values"]
    n_image = int((processor(text=["<image>"], images=[image], return_tensors="pt")["input_ids"]
                   == model.config.image_token_index).sum())
    at = ids.index(IMAGE_TOKEN_INDEX)
    answer = [sp.piece_to_id("▁")] + [sp.piece_to_id(p) for p in written]
    sequence = ids[:at] + [model.config.image_token_index] * n_image + ids[at + 1:] + answer
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sequence]), pixel_values=pixels.double()).logits[0, -1, :BASE_ROWS]
    return torch.softmax(logits, -1).numpy()
