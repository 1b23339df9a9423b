"""EXPERT checked against its official script (hjkim811/EXPERT ``expert.py``, with LLaVA at the commit its
submodule pins and transformers 4.37.2, which it pins).

* The reading of the score: :func:`official_score` against a line-by-line port of the script's block (regular
  expressions, ``float``, ``str(score_check)``, ``(output_ids[0, 1:] == token).nonzero().squeeze()``, the
  softmax of ``output_dict.scores``), on answers covering each of its branches; where the script stops with an
  exception or leaves the sample without a score, the metric has none either.
* The explanation's parsing: :func:`parse_explanation` against the script's ``parse_explanation``.
* End to end, on tiny LLaVA-1.5 checkpoints around the real Llama 2 tokenizer (skipped where its file is absent;
  tests/test_real_tokenizers.py says how to get it), their LM heads scripted so that greedy decoding writes a
  chosen answer while the digit distributions stay soft and depend on the image and the caption: the prompts'
  token ids are those of LLaVA's ``tokenizer_image_token`` (each piece around the image tokenised on its own),
  and the scores, answers and explanations equal a plain implementation of the script's loop (one sample at a
  time, no cache, greedy over the first 32,000 rows, ``[BOS] + answer`` as transformers 4.37 returns it, LLaVA's
  ``KeywordsStoppingCriteria`` ported as it is), whatever the batch size.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HANG_GUARD, random_image

from capeval_plugins.models.lvlm import LLAVA_CONVERSATIONS, KeywordStop
from capeval_plugins.metrics.expert import (CRITERIA, EXPERT, explanation_prompt, official_score, parse_explanation,
                                            scoring_prompt)
from capeval_plugins.testing import scratch_folder
from capeval_plugins.testing.official_code import expand2square

# --- the script's code, ported line by line (its names kept) --------------------------------------------------


class ScriptStopped(Exception):
    """The script raises here (or leaves the sample without an ``expert_score``, a KeyError later)."""


def script_score(outputs: str, output_ids: torch.Tensor, scores: tuple, rate2token: dict) -> float:
    """expert.py's scoring block; ``output_ids`` (1, 1 + k) as generate returns it ([BOS] + answer), ``scores`` one
    (1, V) float tensor per answer token."""
    try:
        dotsnumbersdots = re.sub(r'[^\d\.]', '', outputs)
        numbersdots = re.sub(r'^\.+', '', dotsnumbersdots)
        numbers = re.sub(r'\.+$', '', numbersdots)
        score_check = float(numbers)
        if score_check < 0 or score_check > 1:
            raise ScriptStopped("continue: no expert_score")
        elif score_check < 1.0:
            num_index_in_score = str(score_check).index('.') + 1
            find_num = int(str(score_check)[num_index_in_score])
            num_index_in_token = (output_ids[0, 1:] == rate2token[find_num]).nonzero().squeeze()
            if len(num_index_in_token.shape) > 0:
                if find_num == 0:
                    num_index_in_token = num_index_in_token[1]
                else:
                    num_index_in_token = num_index_in_token[0]
            probs = scores[num_index_in_token]
            probs = torch.nn.functional.softmax(probs, dim=-1)[0]
            score = 0.
            for rate, token in rate2token.items():
                score += probs[token] * rate * 0.1
            if len(str(score_check)) > 3:
                num2_index_in_score = str(score_check).index('.') + 2
                find_num2 = int(str(score_check)[num2_index_in_score])
                num2_index_in_token = (output_ids[0, 1:] == rate2token[find_num2]).nonzero().squeeze()
                if len(num2_index_in_token.shape) > 0:
                    num2_index_in_token = num2_index_in_token[1]
                probs2 = scores[num2_index_in_token]
                probs2 = torch.nn.functional.softmax(probs2, dim=-1)[0]
                for rate, token in rate2token.items():
                    score += probs2[token] * rate * 0.01
        else:
            num_index_in_token = (output_ids[0, 1:] == rate2token[1]).nonzero().squeeze()
            probs = scores[num_index_in_token]
            probs = torch.nn.functional.softmax(probs, dim=-1)[0]
            score = 0.9 * probs[rate2token[0]] + probs[rate2token[1]]
        return score.item()
    except (ValueError, IndexError, TypeError) as err:
        raise ScriptStopped(str(err)) from err


def script_parse_explanation(outputs: str):
    try:
        regex = r"Fluency:\s*(.*?)\nRelevance:\s*(.*?)\nDescriptiveness:\s*(.*)"
        m = re.search(regex, outputs, re.DOTALL)
        if m:
            return {'fluency': m.group(1).strip(), 'relevance': m.group(2).strip(),
                    'descriptiveness': m.group(3).strip()}
        raise ValueError()
    except Exception:
        return None


class KeywordsStoppingCriteria:
    """LLaVA's llava/mm_utils.py class, as it is (batch of one)."""

    def __init__(self, keywords, tokenizer, input_ids):
        self.keywords = keywords
        self.keyword_ids = []
        self.max_keyword_len = 0
        for keyword in keywords:
            cur_keyword_ids = tokenizer(keyword).input_ids
            if len(cur_keyword_ids) > 1 and cur_keyword_ids[0] == tokenizer.bos_token_id:
                cur_keyword_ids = cur_keyword_ids[1:]
            if len(cur_keyword_ids) > self.max_keyword_len:
                self.max_keyword_len = len(cur_keyword_ids)
            self.keyword_ids.append(torch.tensor(cur_keyword_ids))
        self.tokenizer = tokenizer
        self.start_len = input_ids.shape[1]

    def __call__(self, output_ids, scores, **kwargs) -> bool:
        offset = min(output_ids.shape[1] - self.start_len, self.max_keyword_len)
        for keyword_id in self.keyword_ids:
            truncated_output_ids = output_ids[0, -keyword_id.shape[0]:]
            if torch.equal(truncated_output_ids, keyword_id):
                return True
        outputs = self.tokenizer.batch_decode(output_ids[:, -offset:], skip_special_tokens=True)[0]
        for keyword in self.keywords:
            if keyword in outputs:
                return True
        return False


def tokenizer_image_token(prompt, tokenizer, image_token_index):
    """llava/mm_utils.py's function (the image as ``image_token_index``)."""
    prompt_chunks = [tokenizer(chunk).input_ids for chunk in prompt.split('<image>')]

    def insert_separator(X, sep):
        return [ele for sublist in zip(X, [sep] * len(X)) for ele in sublist][:-1]

    input_ids = []
    offset = 0
    if len(prompt_chunks) > 0 and len(prompt_chunks[0]) > 0 and prompt_chunks[0][0] == tokenizer.bos_token_id:
        offset = 1
        input_ids.append(prompt_chunks[0][0])
    for x in insert_separator(prompt_chunks, [image_token_index] * (offset + 1)):
        input_ids.extend(x[offset:])
    return input_ids


# --- the reading of scores and explanations, without a model -------------------------------------------------

DIGITS = list(range(100, 110))  # token ids of "0".."9" in these synthetic answers
OTHER = {".": 7, "▁": 5, "#": 9, "a": 11, "/": 12, "e": 13, "-": 14, "٣": 15, "\n": 16}
ANSWERS = ["0.75", " 0.8", "0.05", "0.50", "0.00", "0.0", "1.0", "1", "1.00", "0.123", "0.122", "0.55", ".5", "0.5.",
           "2", "0.8.2", "", "no idea", "8/10", "0.000015", "0.0000125", "0.7\n1", "1.0 1", "00.5", "٣", "0.٣",
           "0.9###", "a 0.3 a", "0.30000000000000004"]


def synthetic(answer: str, seed: int):
    """Token ids (one per character, digits as DIGITS) and random logits for every step."""
    ids = [DIGITS[int(c)] if c in "0123456789" else OTHER.get(c, 20 + ord(c) % 50) for c in answer]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(ids), 128, generator=gen) * 3
    return ids, logits


@pytest.mark.parametrize("k", range(len(ANSWERS)))
def test_the_score_is_read_as_the_script_reads_it(k):
    answer = ANSWERS[k]
    ids, logits = synthetic(answer, k)
    rate2token = dict(enumerate(DIGITS))
    output_ids = torch.tensor([[1] + ids])
    try:
        want = script_score(answer.strip(), output_ids, tuple(logits[i:i + 1] for i in range(len(ids))), rate2token)
    except ScriptStopped:
        want = None
    got = official_score(answer, ids, torch.log_softmax(logits, -1)[:, DIGITS], DIGITS)
    if want is None:
        assert isinstance(got, str) and got, (answer, got)
    else:
        assert not isinstance(got, str), (answer, got)
        assert got == pytest.approx(want, abs=2e-6)  # float32 softmax in the script, float64 here


def read(answer: str):
    ids, logits = synthetic(answer, 0)
    return official_score(answer, ids, torch.log_softmax(logits, -1)[:, DIGITS], DIGITS)


def test_the_branches_the_answers_cover():
    """The answers above reach every branch of the script: two decimals, a zero first decimal read at its second
    zero, a dropped trailing zero, 1.0, and each way of getting no score."""
    got = {a: read(a) for a in ANSWERS}
    assert all(isinstance(got[a], float) for a in ("0.75", "0.05", "0.50", "1.0", "1", "0.123", "0.0000125", "00.5"))
    assert all(isinstance(got[a], str) for a in ("2", "0.8.2", "", "no idea", "8/10", ".5", "0.000015", "1.0 1"))


@pytest.mark.parametrize("text", [
    "Fluency: Good.\nRelevance: Mostly.\nDescriptiveness: Brief.",
    "Fluency:  fine\n\nRelevance: ok\nDescriptiveness: vague\nmore lines###",
    "Fluency: a\nRelevance: b",
    "fluency: a\nrelevance: b\ndescriptiveness: c",
    "Intro\nFluency:\nRelevance:\nDescriptiveness:",
    "",
])
def test_explanations_are_parsed_as_the_script_parses_them(text):
    assert parse_explanation(text) == script_parse_explanation(text)


def test_the_prompts_and_conversations_are_the_scripts():
    caption = "A dog runs on the grass."
    assert scoring_prompt(caption) == ("Evaluate the caption and assign a score on a scale of 0.0 to 1.0.\n\n"
                                       "Caption: A dog runs on the grass.\n\nScore (0.0~1.0):")
    assert explanation_prompt(caption).endswith(
        "Output Format:\nFluency: {Provide explanation here.}\nRelevance: {Provide explanation here.}\n"
        "Descriptiveness: {Provide explanation here.}")
    system = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives "
              "helpful, detailed, and polite answers to the human's questions.")
    v0, v1 = LLAVA_CONVERSATIONS["llava_v0"], LLAVA_CONVERSATIONS["llava_v1"]
    assert v0.prompt([("Q", None)]) == f"{system}###Human: <image>\nQ###Assistant:"
    assert v0.prompt([("Q", "0.5</s>"), ("E", None)]) == (f"{system}###Human: <image>\nQ###Assistant: 0.5</s>"
                                                          "###Human: E###Assistant:")
    assert v1.prompt([("Q", "0.5</s>"), ("E", None)]) == (f"{system} USER: <image>\nQ ASSISTANT: 0.5</s></s>"
                                                          "USER: E ASSISTANT:")
    assert (v0.stop, v1.stop) == ("###", "</s>")


def test_options_are_checked_when_built():
    for option, value in (("conversation", "llava_v2"), ("vocabulary", "some"), ("on_invalid", "zero"),
                          ("image_aspect", "stretch")):
        with pytest.raises(ValueError, match=option):
            EXPERT(**{option: value})


def test_the_default_needs_the_converted_weights():
    needs = EXPERT().requirements()
    model = [r for r in needs if r.kind == "model"]
    assert len(model) == 1 and model[0].target.endswith("expert") and "capeval convert expert" in model[0].remedy


# --- end to end on tiny LLaVA-1.5 checkpoints with the real Llama 2 tokenizer ----------------------------------

# where test_real_tokenizers.py looks: $CAPEVAL_TOKENIZERS, else ../shared/tokenizers beside the clone
TOKENIZERS = Path(os.environ.get("CAPEVAL_TOKENIZERS",
                                 Path(__file__).resolve().parent.parent.parent / "shared" / "tokenizers"))


@lru_cache(maxsize=None)
def llama2_tokenizer():
    from capeval_plugins.testing import real_tokenizers as rt

    pytest.importorskip("sentencepiece", reason="SentencePiece tokenizers need sentencepiece (the test extra)")
    pytest.importorskip("google.protobuf", reason="SentencePiece tokenizers need protobuf (the test extra)")
    model = TOKENIZERS / "llama2" / "tokenizer.model"
    if not model.is_file():
        pytest.skip(f"no Llama 2 tokenizer at {model} (tests/test_real_tokenizers.py says how to get it)")
    return rt.sentencepiece_tokenizer(model, scratch_folder("capeval-llama2-tok-"))


HIDDEN = 128


@lru_cache(maxsize=None)
def scripted_llava15(chain: tuple[str, ...], soft: tuple[tuple[str, float], ...] = ()) -> str:
    """A tiny LLaVA-1.5 around the real Llama 2 tokenizer whose greedy answer follows ``chain`` (each token of the
    chain makes the next one the likeliest, by a margin of about 6 logits; ``chain[0]`` is the prompt's last
    token), while after the tokens named in ``soft`` every digit keeps some probability (the logit of digit d
    raised by about ``weight * d / 9``). The layers are random, so the distributions depend on the image and the
    caption (the scores of the corpus below spread over about 0.03)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from capeval_plugins.testing import real_tokenizers as rt

    tok = llama2_tokenizer()
    text = dict(model_type="llama", vocab_size=rt.LLAVA_VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8, projection_dim=16)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-2, image_seq_length=16)
    torch.manual_seed(len(chain))
    model = LlavaForConditionalGeneration(config)
    ids = tok.convert_tokens_to_ids(list(chain))
    assert len(set(ids[:-1])) == len(ids) - 1 and tok.unk_token_id not in ids, chain
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        head.mul_(0.01)
        unit = {i: embed[i] / embed[i].norm() / math.sqrt(HIDDEN) for i in ids}
        for current, following in zip(ids, ids[1:]):
            head[following] += 9.0 * unit[current]
        for token, weight in soft:
            current = tok.convert_tokens_to_ids(token)
            unit.setdefault(current, embed[current] / embed[current].norm() / math.sqrt(HIDDEN))
            for d in range(10):
                head[tok.convert_tokens_to_ids(str(d))] += weight * d / 9 * unit[current]
    path = scratch_folder("capeval-expert-llava-")
    model.save_pretrained(path)
    processor = rt.clip_image_processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=processor, tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=rt.LLAVA_15_TEMPLATE).save_pretrained(path)
    return str(path)


def script_generate(model, processor, image, prompt: str, stop: str, max_new_tokens: int):
    """The script's ``model.generate``: greedy, one sample, no cache; returns (outputs, output_ids, scores)."""
    tok = processor.tokenizer
    image_id = model.config.image_token_index
    ids = tokenizer_image_token(prompt, tok, image_id)
    mean = processor.image_processor.image_mean
    pixels = processor.image_processor(expand2square(image, tuple(int(x * 255) for x in mean)),
                                       return_tensors="pt")["pixel_values"]
    n_image = int((processor(text=["<image>"], images=[image], return_tensors="pt")["input_ids"] == image_id).sum())
    at = ids.index(image_id)
    expanded = ids[:at] + [image_id] * n_image + ids[at + 1:]
    criteria = KeywordsStoppingCriteria([stop], tok, torch.tensor([ids]))
    output_ids = torch.tensor([[tok.bos_token_id]])
    scores = []
    for _ in range(max_new_tokens):
        sequence = torch.tensor([expanded + output_ids[0, 1:].tolist()])
        with torch.no_grad():
            logits = model(input_ids=sequence, pixel_values=pixels).logits[:, -1, :32000].float()
        scores.append(logits)
        output_ids = torch.cat([output_ids, logits.argmax(-1, keepdim=True)], dim=1)
        if int(output_ids[0, -1]) == tok.eos_token_id or criteria(output_ids, None):
            break
    return tok.batch_decode(output_ids, skip_special_tokens=True)[0].strip(), output_ids, tuple(scores)


def script_run(path: str, images, captions, conversation="llava_v0", explanation=True, max_new_tokens=24):
    """The script's loop over (image, caption) pairs: scores (None where it stops) and explanations."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    tok = processor.tokenizer
    rate2token = {s: tok.encode(str(s))[-1] for s in range(10)}
    conv = LLAVA_CONVERSATIONS[conversation]
    out = []
    for image, caption in zip(images, captions):
        first = conv.prompt([(scoring_prompt(caption), None)])
        outputs, output_ids, scores = script_generate(model, processor, image, first, conv.stop, max_new_tokens)
        try:
            score = script_score(outputs, output_ids, scores, rate2token)
        except ScriptStopped:
            out.append((None, outputs, None))
            continue
        said = None
        if explanation:
            history = str(torch.tensor(score, dtype=torch.float32).item()) + "</s>"
            second = conv.prompt([(scoring_prompt(caption), history), (explanation_prompt(caption), None)])
            said = script_generate(model, processor, image, second, conv.stop, max_new_tokens)[0]
        out.append((score, outputs, said))
    return out


CAPTIONS = ["A dog runs on the grass.", "two  men playing soccer", "A red car.", "", "A cat sleeps on a sofa."]


def corpus():
    images = [random_image(40 + i, size=(40 + 6 * i, 30 + 2 * i)) for i in range(3)]
    index = [0, 0, 1, 2, 2]
    return [images[i] for i in index], CAPTIONS


def expert(path: str, **options):
    return EXPERT(model=path, device="cpu", dtype="float32", max_new_tokens=24, **options)


def test_prompts_are_tokenised_as_llavas_tokenizer_image_token():
    """Both turns, both conversations: the judge's ids are LLaVA's (the piece after the image starts with the
    dummy-prefix "▁", which the llava-hf chat template's one-string tokenisation does not write)."""
    from capeval_plugins.models.lvlm import JudgeSpec, LVLMJudge

    path = scripted_llava15(SCORE_075, SOFT)
    judge = LVLMJudge.shared(JudgeSpec(path, device="cpu", dtype="float32"))
    tok = judge.tokenizer
    for name, conv in LLAVA_CONVERSATIONS.items():
        for caption in CAPTIONS + ["Ünïcode café — «quotes» 123", "a\tb  c"]:
            for prompt in (conv.prompt([(scoring_prompt(caption), None)]),
                           conv.prompt([(scoring_prompt(caption), "0.7234567403793335</s>"),
                                        (explanation_prompt(caption), None)])):
                ours = judge._llava_ids(prompt)
                assert ours == tokenizer_image_token(prompt, tok, judge.image_token_id), (name, caption)
                assert ours.count(tok.bos_token_id) == 1 and ours.count(tok.eos_token_id) == prompt.count("</s>")
    whole = tok(conv.prompt([(scoring_prompt("x"), None)]))["input_ids"]
    split = judge._llava_ids(conv.prompt([(scoring_prompt("x"), None)]))
    at = split.index(judge.image_token_id)
    dummy_prefix, newline = tok.encode("\n", add_special_tokens=False)  # "▁", "<0x0A>"
    assert (split[at + 1], split[at + 2]) == (dummy_prefix, newline) and whole[at + 1] == newline
    stop = KeywordStop.build(["###"], tok)
    assert stop.keyword_ids == ((tok.convert_tokens_to_ids("▁###"),),)


# The answers the scripted judges write (after the prompt's last token ":", whose next is "▁")
SCORE_075 = (":", "▁", "0", ".", "7", "5", "</s>")
SOFT = (("▁", 4.0), (".", 6.0), ("7", 6.0))


def test_scores_and_explanations_equal_the_scripts_on_a_scripted_judge():
    """'0.75' then the end of sequence: the smoothed score (first and second decimals, soft digit distributions
    that differ by image and caption) equals the script's; the explanation turn, with that score in the
    history, gives the script's answer (here the same scripted "0.75", not in the three-part format)."""
    path = scripted_llava15(SCORE_075, SOFT)
    images, captions = corpus()
    want = script_run(path, images, captions)
    result = expert(path, batch_size=4)(images, captions)
    scores = result.scores.numpy()
    assert all(w[0] is not None for w in want)
    np.testing.assert_allclose(scores, [w[0] for w in want], rtol=0, atol=2e-5)
    assert len(set(np.round(scores, 6))) > 2  # the distributions differ by image and caption
    assert 0.07 < scores.min() and scores.max() < 0.8
    assert result.extras["raw_score"].tolist() == [0.75] * len(captions)
    assert result.extras["explanation"] == [w[2] for w in want] == ["0.75"] * len(captions)
    assert result.extras["fluency"] == [None] * len(captions)
    assert result.corpus_extras["n_unparsed_explanations"] == len(captions)
    assert result.corpus_extras["n_invalid"] == 0


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_batching_does_not_change_scores_or_explanations(batch_size):
    path = scripted_llava15(SCORE_075, SOFT)
    images, captions = corpus()
    reference = expert(path, batch_size=3)(images, captions)
    result = expert(path, batch_size=batch_size)(images, captions)
    np.testing.assert_allclose(result.scores.numpy(), reference.scores.numpy(), rtol=0, atol=1e-6)
    assert result.extras["explanation"] == reference.extras["explanation"]


def test_a_one_and_the_keyword_stop():
    """'1.0' (0.9 P('0') + P('1') at the '1'); '0.7' ended by the token '▁###' (the keyword's own ids); and
    '0.6' followed by '##' '#' and more text, where the script's decoded window finds "###" only once the answer
    is about half as long as the prompt (LLaVA's quirk, kept): each as the script reads it."""
    images, captions = corpus()
    for chain in ((":", "▁", "1", ".", "0", "</s>"),
                  (":", "▁", "0", ".", "7", "▁###", "▁Human"),
                  (":", "▁", "0", ".", "6", "##", "#", "▁Human", "▁says", "▁hello", "▁and", "▁goes")):
        path = scripted_llava15(chain, SOFT)
        want = script_run(path, images[:2], captions[:2], explanation=False, max_new_tokens=200)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an answer that runs on may hold no score: NaN, as the script has none
            result = EXPERT(model=path, device="cpu", dtype="float32", explanation=False,
                            max_new_tokens=200)(images[:2], captions[:2])
        expected = [math.nan if w[0] is None else w[0] for w in want]
        np.testing.assert_allclose(result.scores.numpy(), expected, rtol=0, atol=2e-5)
        assert result.extras["explanation"] == [None, None] and "n_unparsed_explanations" not in result.corpus_extras
    # the quirk: with "##" "#" the answer runs on past the "###"
    assert "###" in want[0][1] and len(want[0][1]) > len("0.6###")


def test_an_answer_without_a_score_is_nan_counted_or_an_error():
    """'2' (outside 0-1; the script leaves the sample without a score and fails later): NaN, counted in
    n_invalid, no explanation asked; on_invalid='raise' stops, as the script does."""
    path = scripted_llava15((":", "▁", "2", "</s>"), SOFT)
    images, captions = corpus()
    assert all(w[0] is None for w in script_run(path, images[:2], captions[:2]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = expert(path)(images[:2], captions[:2])
    assert np.isnan(result.scores.numpy()).all() and result.corpus_extras["n_invalid"] == 2
    assert result.extras["explanation"] == [None, None] and result.extras["raw_score"].tolist() == [2.0, 2.0]
    assert any("outside 0.0-1.0" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="no valid score in the judge's answer for sample 0: .*outside 0.0-1.0"):
        expert(path, on_invalid="raise")(images[:2], captions[:2])


def test_the_full_vocabulary_option_reads_every_row():
    """vocabulary='full' takes the softmax over all 32,064 rows of the transformers checkpoint: with the extra
    rows raised, the digit probabilities (and the score) drop; 'base' reads the 32,000 rows the script has."""
    from transformers import LlavaForConditionalGeneration

    src = scripted_llava15(SCORE_075, SOFT)
    model = LlavaForConditionalGeneration.from_pretrained(src)
    tok = llama2_tokenizer()
    with torch.no_grad():  # the extra rows as likely as 7 logits after "." and "7", below the scripted 9
        embed = model.get_input_embeddings().weight
        steps = [embed[tok.convert_tokens_to_ids(t)] for t in (".", "7")]
        model.get_output_embeddings().weight[32000:] = sum(7.0 * e / e.norm() / math.sqrt(HIDDEN) for e in steps)
    path = scratch_folder("capeval-expert-full-")
    model.save_pretrained(path)
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(src).save_pretrained(path)
    images, captions = corpus()
    base = expert(str(path), explanation=False)(images[:2], captions[:2]).scores
    full = expert(str(path), explanation=False, vocabulary="full")(images[:2], captions[:2]).scores
    want = [w[0] for w in script_run(str(path), images[:2], captions[:2], explanation=False)]
    np.testing.assert_allclose(base.numpy(), want, rtol=0, atol=2e-5)
    assert (full < base).all()


def test_a_parsed_explanation_fills_its_three_parts(monkeypatch):
    """The explanation's three parts land in their extras (an explanation the judge writes in the format)."""
    path = scripted_llava15(SCORE_075, SOFT)
    images, captions = corpus()
    metric = expert(path)
    judge = metric.judge
    real = type(judge).judge
    said = "Fluency: Natural.\nRelevance: It shows a dog.\nDescriptiveness: Brief.###"

    def judged(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if "Provide a brief explanation" in args[2][0]:  # a copy: the judge keeps its answers for the next call
            return dataclasses.replace(out, texts=[said] * len(out.texts))
        return out

    monkeypatch.setattr(type(judge), "judge", judged)
    result = metric(images[:2], captions[:2])
    assert result.extras["explanation"] == [said] * 2
    assert result.extras["fluency"] == ["Natural."] * 2 and result.extras["descriptiveness"] == ["Brief.###"] * 2
    assert result.corpus_extras["n_unparsed_explanations"] == 0
    rows = result.rows()
    assert rows[0]["relevance"] == "It shows a dog." and set(CRITERIA) <= set(rows[0])


def test_every_entry_point_keeps_the_explanations(tmp_path):
    """The score and the per-sample explanation through evaluate, torchmetrics, pycocoevalcap and `capeval score`
    (a tiny scripted judge whose explanation turn writes '0.8', as its score turn does)."""
    import json
    import subprocess
    import sys as _sys

    import evaluate
    from test_lvlm import scripted_llava
    from test_resume_every_metric import EXPERT_JUDGE

    import capeval_plugins.pycocoevalcap as coco
    from capeval_plugins.torchmetrics import EXPERT as TorchEXPERT

    judge = scripted_llava(EXPERT_JUDGE)
    options = {"model": judge, "max_new_tokens": 8}
    images = [random_image(3), random_image(4)]
    paths = []
    for k, image in enumerate(images):
        image.save(tmp_path / f"{k}.png")
        paths.append(str(tmp_path / f"{k}.png"))
    captions = ["a dog on grass", ""]
    direct = EXPERT(**options)(paths, captions)
    assert direct.extras["explanation"] == ["0.8", "0.8"] and not np.isnan(direct.scores.numpy()).any()

    out = evaluate.load("expert", **options).compute(images=paths, predictions=captions)
    assert out["explanation"] == direct.extras["explanation"] and out["scores"] == direct.scores.tolist()

    metric = TorchEXPERT(**options)
    metric.update(paths[:1], captions[:1])
    metric.update(paths[1:], captions[1:])
    result = metric.compute_all()
    assert result.extras["explanation"] == direct.extras["explanation"]
    assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-9)

    skipped = EXPERT(**options, on_error="skip")(paths + paths[:1], captions + ["a <image> in the caption"])
    assert "image placeholder" in skipped.skipped[2] and skipped.extras["explanation"][:2] == ["0.8", "0.8"]

    scorer = coco.Expert(coco.ImageResolver(tmp_path, pattern="{id}.png"), **options)
    written = {i: [{"caption": c}] for i, c in enumerate(captions)}  # COCO's form: the captions as written
    score, items = scorer.compute_score({0: [{"caption": "R."}], 1: [{"caption": "R."}]}, written)
    assert items == pytest.approx(direct.scores.tolist(), abs=1e-9)
    assert scorer.last_result.extras["explanation"] == direct.extras["explanation"]

    rows = tmp_path / "captions.jsonl"
    rows.write_text("".join(json.dumps({"image": p, "caption": c}) + "\n" for p, c in zip(paths, captions)))
    done = subprocess.run([_sys.executable, "-m", "capeval_plugins.cli", "score", "-m", "expert", "--captions",
                           str(rows), "--out", str(tmp_path / "out.jsonl"), "-o", f"model={judge}",
                           "-o", "max_new_tokens=8", "--quiet"], capture_output=True, text=True, timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["expert.explanation"] for r in written] == direct.extras["explanation"]
    assert [r["expert.fluency"] for r in written] == [None, None]
