"""The batched LVLM judge against transformers' own one-prompt-at-a-time ``generate`` on tiny random LVLMs
(LLaVA-NeXT; Qwen2-VL, Qwen2.5-VL and Qwen3-VL through their real processors where torchvision imports, and
everywhere through a stand-in checked against the real one), plus parsing, stopping, invariances, prefix
sharing and the out-of-memory fallback."""
from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
import pytest
import torch
from conftest import needs_torchvision, random_image

from capeval_plugins.models.lvlm import SCALES, JudgeSpec, LVLMJudge, fleur_instruction
from capeval_plugins.testing import scratch_folder

CAPTIONS = ["A dog runs on the grass.", "Two children play in the park!", "A red car next to a building",
            "An old man sits on a bench under a tree.", "a cat", "A very long caption about a small brown dog that "
            "runs after a red ball across a wide green field on a sunny day."]
IMAGE_OF = [0, 0, 1, 1, 2, 0]
DECIMAL = SCALES["0.0-1.0"]


def images():
    return [random_image(i, size=(40 + 8 * i, 36 + 4 * i)) for i in range(3)]


@lru_cache(maxsize=None)
def sharp_llava() -> str:
    """The tiny LLaVA-NeXT with its matrices scaled by 3, so that answers and distributions depend visibly on
    the image and the caption (the plain random one is nearly uniform)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from capeval_plugins.testing import tiny_checkpoint

    src = tiny_checkpoint("llava_next")
    out = scratch_folder("capeval-sharp-llava-")
    model = AutoModelForImageTextToText.from_pretrained(src)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(3)
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(src).save_pretrained(out)
    return str(out)


@lru_cache(maxsize=None)
def scripted_llava(chain: tuple[str, ...]) -> str:
    """A tiny LLaVA-NeXT that writes a fixed answer greedily: the layers add nothing to the residual stream (their
    norms' weights zero: attention and MLP read zeros; a weight matrix of zeros would be refused as a download cut
    short), so the last hidden state is the normalised embedding of the current token, and the LM head maps each
    token of ``chain`` to the next one (a bigram table). ``chain`` starts with the prompt's last token."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from capeval_plugins.testing import tiny_checkpoint

    src = tiny_checkpoint("llava_next")
    out = scratch_folder("capeval-scripted-llava-")
    model = AutoModelForImageTextToText.from_pretrained(src)
    processor = AutoProcessor.from_pretrained(src)
    ids = processor.tokenizer.convert_tokens_to_ids(list(chain))
    assert len(set(ids[:-1])) == len(ids) - 1, "each token may lead to one next token"
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.input_layernorm.weight.zero_()
            layer.post_attention_layernorm.weight.zero_()
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        head.zero_()
        for current, following in zip(ids, ids[1:]):
            head[following] = 20 * embed[current] / embed[current].norm()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return str(out)


@lru_cache(maxsize=None)
def tiny_llava15() -> str:
    """A tiny LLaVA-1.5 (FLEUR's family: one image tile, Llama text model), built like the package's builders."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from capeval_plugins.testing.vision_language import MISTRAL_LLAVA_TEMPLATE, mistral_tokenizer

    tok = mistral_tokenizer()
    text = dict(model_type="llama", vocab_size=len(tok) + 40, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, projection_dim=16)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-2, image_seq_length=16)
    path = str(scratch_folder("capeval-llava15-"))
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(3)
    model.save_pretrained(path)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=MISTRAL_LLAVA_TEMPLATE).save_pretrained(path)
    return path


def plain_generate(path: str, image, instruction: str, steps: int):
    """transformers alone: one prompt, ``generate`` greedy with raw logits and the last hidden states."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    enc = processor(text=[text], images=[image], return_tensors="pt")
    config = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0)
    with torch.no_grad():
        g = model.generate(**enc, generation_config=config, output_logits=True, output_hidden_states=True,
                           return_dict_in_generate=True)
    new = g.sequences[0, enc["input_ids"].shape[1]:]
    logprobs = torch.stack([torch.log_softmax(x[0].float(), -1) for x in g.logits])
    hidden = torch.stack([h[-1][0, -1] for h in g.hidden_states])
    return new, logprobs, hidden


@pytest.fixture(scope="module")
def sharp_judge() -> LVLMJudge:
    return LVLMJudge.shared(JudgeSpec(sharp_llava()))


def run_judge(judge: LVLMJudge, order=None, **kwargs):
    judge.results.clear()  # the judge keeps its last answers (shared_results): these tests count its work
    order = list(range(len(CAPTIONS))) if order is None else order
    ins = [fleur_instruction(CAPTIONS[i]) for i in order]
    return judge.judge(images(), [IMAGE_OF[i] for i in order], ins, DECIMAL, **kwargs)


# --- parsing and prompts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value, chars", [
    ("0.85", 0.85, (0, 2, 3)), ("0.0", 0.0, (0, 2, -1)), ("1.0", 1.0, (0, 2, -1)), (" 1.00", 1.0, (1, 3, 4)),
    ("0.8 (out of 1.0)", 0.8, (0, 2, -1)), ("Score: 0.6", 0.6, (7, 9, -1)), ("0.853", 0.853, (0, 2, 3)),
])
def test_decimal_scale_parses_valid_scores(text, value, chars):
    parsed = DECIMAL.parse(text)
    assert parsed.value == pytest.approx(value) and parsed.chars == chars
    assert parsed.labels == tuple(int(text[c]) if c >= 0 else -1 for c in chars)


@pytest.mark.parametrize("text", ["The caption is good.", "", "1.5", "1.05", "-0.5", "1", "0", "10.5", "0."])
def test_decimal_scale_refuses_anything_else(text):
    assert isinstance(DECIMAL.parse(text), str)


def test_discrete_and_letter_scales():
    five, letters = SCALES["1-5"], SCALES["A-E"]
    assert five.parse("4").value == 4.0 and five.parse(" 4 out of 5").chars == (1,)
    assert all(isinstance(five.parse(t), str) for t in ("6", "4.5", "0", "four"))
    assert letters.parse("B").value == 2.0 and letters.parse("Score: C.").labels == (2,)
    assert all(isinstance(letters.parse(t), str) for t in ("A dog", "F", "The answer is B"))
    assert SCALES["0-9"].parse("7/9").value == 7.0
    # complete: the score is written and cannot change any more
    assert [DECIMAL.complete(t) for t in ("0", "0.", "0.8", "0.8 ", "0.85", "1.0\n", "Score")] == \
        [False, False, False, True, True, True, False]
    assert [letters.complete(t) for t in ("B", "B.", "A dog")] == [False, True, False]


def test_prompts_are_the_papers():
    assert fleur_instruction("  a  dog\nruns ") == (
        "Your task is to evaluate and rate the caption on a scale of 0.0 to 1.0 based on the given Grading "
        "Criteria. (Print Real Number Score ONLY)\n\nGrading Criteria:\n\n0.0: The caption does not describe the "
        "image at all.\n1.0: The caption accurately and clearly describes the image.\n\nCaption: a dog runs\n\n"
        "Score(Choose a rating from 0.0 to 1.0):")
    ref = fleur_instruction("a dog", ["a  dog runs", "a puppy"])
    assert ref.startswith("Your task is to evaluate and rate the candidate caption on a scale of 0.0 to 1.0")
    assert ref.endswith("image.\n\nReference Captions: a dog runs\na puppy\n\nCandidate Caption: a dog\n\n"
                        "Score(Choose a rating from 0.0 to 1.0):")
    five = fleur_instruction("a dog", scale=SCALES["1-5"])
    assert "0.0" not in five and "scale of 1 to 5" in five and "\n5: The caption accurately" in five


# --- agreement with transformers -------------------------------------------------------------------------------


def test_answers_equal_transformers_generate_one_prompt_at_a_time(sharp_judge):
    out = run_judge(sharp_judge, max_new_tokens=4, batch_size=4)
    table = out.label_table[0]
    for i in (0, 2, 5):
        new, logprobs, hidden = plain_generate(sharp_llava(), images()[IMAGE_OF[i]], fleur_instruction(CAPTIONS[i]), 4)
        assert out.tokens[i].tolist() == new.tolist()
        assert torch.allclose(out.label_logprobs[i], logprobs[:, table], atol=1e-5)
        assert torch.allclose(out.hidden[i], hidden, atol=1e-4)
    # the distributions depend on the inputs far beyond the tolerances used here
    assert (out.label_logprobs - out.label_logprobs[:1]).abs().max() > 1e-2


def test_llava_1_5_family_equals_generate():
    judge = LVLMJudge.shared(JudgeSpec(tiny_llava15()))
    out = run_judge(judge, max_new_tokens=3, batch_size=4)
    table = out.label_table[0]
    for i in (1, 5):
        new, logprobs, _ = plain_generate(tiny_llava15(), images()[IMAGE_OF[i]], fleur_instruction(CAPTIONS[i]), 3)
        assert out.tokens[i].tolist() == new.tolist()
        assert torch.allclose(out.label_logprobs[i], logprobs[:, table], atol=1e-5)


def test_label_distribution_is_the_softmax_of_lm_head_rows_times_the_hidden_state(sharp_judge):
    out = run_judge(sharp_judge, max_new_tokens=4)
    weight, bias = sharp_judge.lm_head_rows(out.label_table[0])
    assert bias is None
    from_hidden = torch.log_softmax(out.hidden @ weight.T, -1)
    assert torch.allclose(from_hidden, torch.log_softmax(out.label_logprobs, -1), atol=1e-5)


def test_results_do_not_depend_on_batch_size_padding_or_composition(sharp_judge):
    reference = run_judge(sharp_judge, max_new_tokens=4, batch_size=6)
    # another order: the candidates of image 0 apart, the long caption (most padding) first
    order = [5, 2, 0, 4, 3, 1]
    for batch_size in (1, 2, 4):
        other = run_judge(sharp_judge, order=order, max_new_tokens=4, batch_size=batch_size)
        for j, i in enumerate(order):
            assert other.tokens[j].tolist() == reference.tokens[i].tolist()
            assert torch.allclose(other.label_logprobs[j].exp(), reference.label_logprobs[i].exp(), atol=1e-5)
    # a sample alone, with nothing of its image shared
    alone = sharp_judge.judge(images(), [IMAGE_OF[3]], [fleur_instruction(CAPTIONS[3])], DECIMAL, max_new_tokens=4)
    assert torch.allclose(alone.label_logprobs[0].exp(), reference.label_logprobs[3].exp(), atol=1e-5)
    # the tokenizer's own padding side plays no part (the judge pads on the left itself)
    sharp_judge.tokenizer.padding_side = "right"
    try:
        right = run_judge(sharp_judge, max_new_tokens=4, batch_size=3)
    finally:
        sharp_judge.tokenizer.padding_side = "left"
    assert torch.allclose(right.label_logprobs.exp(), reference.label_logprobs.exp(), atol=1e-5)


def test_each_image_is_encoded_once_per_chunk(sharp_judge):
    tower = sharp_judge.model.model.vision_tower

    def patch_rows(**kwargs) -> list[int]:
        seen = []
        handle = tower.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[0]))
        try:
            run_judge(sharp_judge, **kwargs) if "order" in kwargs else sharp_judge.judge(
                images(), [0, 1, 2], [fleur_instruction(CAPTIONS[0])] * 3, DECIMAL, max_new_tokens=1)
        finally:
            handle.remove()
        return seen

    six_captions = patch_rows(order=None, max_new_tokens=2, batch_size=6)
    three_images = patch_rows()
    assert len(six_captions) == 1 and six_captions == three_images  # one pass, each image's patches once


def test_out_of_memory_halves_the_chunk_and_keeps_the_results(sharp_judge, monkeypatch):
    reference = run_judge(sharp_judge, max_new_tokens=3, batch_size=6)
    real = LVLMJudge._run_chunk
    sizes = []

    def flaky(self, run, rows, table):
        sizes.append(len(rows))
        if len(rows) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, run, rows, table)

    monkeypatch.setattr(LVLMJudge, "_run_chunk", flaky)
    with pytest.warns(UserWarning, match="out of memory"):
        out = run_judge(sharp_judge, max_new_tokens=3, batch_size=6)
    assert sizes == [6, 3, 3]
    assert torch.allclose(out.label_logprobs.exp(), reference.label_logprobs.exp(), atol=1e-5, equal_nan=True)
    assert out.texts == reference.texts

    def always(self, run, rows, table):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(LVLMJudge, "_run_chunk", always)
    with pytest.raises(torch.OutOfMemoryError), pytest.warns(UserWarning):
        run_judge(sharp_judge, max_new_tokens=3, batch_size=2)


# --- forced answers, stopping, label forms -----------------------------------------------------------------------


def test_forced_answers_are_read_at_their_digit_tokens(sharp_judge):
    forced = ["0.85", "1.0", "0.3 (out of 1.0)", "zero", "0.07", "0.5"]
    out = run_judge(sharp_judge, forced=forced)
    assert out.texts == forced
    assert out.raw[:3].tolist() == [0.85, 1.0, 0.3] and torch.isnan(out.raw[3]) and out.errors[3]
    tok = sharp_judge.tokenizer
    for i in (0, 1, 2, 4, 5):
        for j, label in enumerate(out.labels[i].tolist()):
            step = int(out.positions[i, j])
            assert (step < 0) == (label < 0)
            if step >= 0:
                assert tok.decode([int(out.tokens[i, step])]).strip() == str(label)
                assert out.logprobs_at(j)[i, label] == out.label_logprobs[i, step, label]
    # teacher forcing reads the same distributions as generation at the steps they share
    free = run_judge(sharp_judge, max_new_tokens=1)
    assert torch.allclose(out.label_logprobs[:, 0], free.label_logprobs[:, 0], atol=1e-6)


def test_letter_labels_are_read_in_the_form_written(sharp_judge):
    table = sharp_judge.label_table(SCALES["A-E"].labels)
    assert table.shape == (2, 5)  # "A".."E" and "▁A".."▁E"
    out = sharp_judge.judge(images(), [0, 1], [fleur_instruction("a dog", scale=SCALES["A-E"])] * 2, SCALES["A-E"],
                            forced=["B", "C"])
    assert out.raw.tolist() == [2.0, 3.0]
    step = int(out.positions[0, 0])
    written = int(out.tokens[0, step])
    form = int(out.label_variant[0, step])
    assert written in table[form].tolist()
    assert torch.equal(out.label_ids_at(0)[0], table[form])


def test_greedy_answers_stop_as_soon_as_the_score_is_written():
    # "0.8A": complete at the 'A', long before the budget
    judge = LVLMJudge.shared(JudgeSpec(scripted_llava(("▁[/INST]", "▁", "0", ".", "8", "A", "▁dog"))))
    out = run_judge(judge, max_new_tokens=10)
    assert out.texts == ["0.8A"] * 6 and out.tokens.shape[1] == 5
    assert out.raw.tolist() == [0.8] * 6 and out.positions[0].tolist() == [1, 3, -1]
    # the end-of-sequence token ends an answer; a budget too short leaves no valid score
    judge = LVLMJudge.shared(JudgeSpec(scripted_llava(("▁[/INST]", "▁", "1", ".", "0", "</s>", "▁dog"))))
    out = run_judge(judge, max_new_tokens=10)
    assert out.texts == ["1.0"] * 6 and out.tokens.shape[1] == 5 and out.tokens[0, -1] == judge.tokenizer.eos_token_id
    short = run_judge(judge, max_new_tokens=3)
    assert short.texts == ["1."] * 6 and torch.isnan(short.raw).all() and "decimal digit" in short.errors[0]


def test_generation_config_does_not_reach_the_judge():
    import copy

    judge = LVLMJudge.shared(JudgeSpec(scripted_llava(("▁[/INST]", "▁", "0", ".", "8", "A", "▁dog"))))
    expected = run_judge(judge, max_new_tokens=10)
    saved = copy.deepcopy(judge.model.generation_config)
    config = judge.model.generation_config
    config.do_sample, config.temperature, config.repetition_penalty, config.max_new_tokens = True, 50.0, 100.0, 1
    try:
        again = run_judge(judge, max_new_tokens=10)
    finally:
        judge.model.generation_config = saved
    assert again.texts == expected.texts and torch.equal(again.label_logprobs, expected.label_logprobs)


# --- Qwen-VL families ------------------------------------------------------------------------------------------


class QwenProcessorStandIn:
    """What Qwen2-VL's processor does for images, without its video processor (which needs torchvision):
    each <|image_pad|> becomes grid_t * grid_h * grid_w / merge^2 copies; mm_token_type_ids marks them."""

    image_token = "<|image_pad|>"

    def __init__(self, path: str):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path)

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text, images, return_tensors="pt", **kwargs):
        vision = self.image_processor(images=images, return_tensors="pt")
        counts = iter((vision["image_grid_thw"].prod(-1) // self.image_processor.merge_size ** 2).tolist())
        texts = [re.sub(re.escape(self.image_token), lambda _m: "\0" * next(counts), t) for t in text]
        enc = self.tokenizer([t.replace("\0", self.image_token) for t in texts], return_tensors="pt", **kwargs)
        image_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        return {**enc, "mm_token_type_ids": (enc["input_ids"] == image_id).long(), **vision}


@lru_cache(maxsize=None)
def qwen_checkpoint(kind: str) -> str:
    from capeval_plugins.testing import build_tiny

    path = str(scratch_folder(f"capeval-{kind}-"))
    try:
        build_tiny(kind, path)
    except RuntimeError:  # no torchvision: the model, tokenizer and image processor are saved, not the processor
        pass
    return path


QWEN_KINDS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
PROCESSORS = ["stand-in", pytest.param("real", marks=needs_torchvision)]


def qwen_judge(kind: str, processor: str) -> LVLMJudge:
    """The real processor through the user's path (``LVLMJudge.shared``: the checkpoint's own processor), or the
    stand-in around the same model where torchvision is missing."""
    from transformers import AutoModelForImageTextToText

    path = qwen_checkpoint(kind)
    if processor == "real":
        return LVLMJudge.shared(JudgeSpec(path))
    return LVLMJudge(AutoModelForImageTextToText.from_pretrained(path).eval(), QwenProcessorStandIn(path))


@pytest.mark.parametrize("processor", PROCESSORS)
@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_qwen_families_equal_generate_with_their_own_rope_positions(kind, processor):
    judge = qwen_judge(kind, processor)
    assert isinstance(judge.processor, QwenProcessorStandIn) == (processor == "stand-in")
    model, processor = judge.model, judge.processor
    ins = [fleur_instruction(c) for c in CAPTIONS]
    out = judge.judge(images(), IMAGE_OF, ins, DECIMAL, max_new_tokens=3, batch_size=6)
    one_by_one = judge.judge(images(), IMAGE_OF, ins, DECIMAL, max_new_tokens=3, batch_size=1)
    assert torch.allclose(out.label_logprobs.exp(), one_by_one.label_logprobs.exp(), atol=1e-5, equal_nan=True)
    table = out.label_table[0]
    for i in (1, 5):
        enc = processor(text=[judge.chat(ins[i])], images=[images()[IMAGE_OF[i]]], return_tensors="pt")
        with torch.no_grad():
            g = model.generate(**enc, max_new_tokens=3, min_new_tokens=3, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        assert out.tokens[i].tolist() == g.sequences[0, enc["input_ids"].shape[1]:].tolist()
        expected = torch.stack([torch.log_softmax(x[0].float(), -1)[table] for x in g.logits])
        assert torch.allclose(out.label_logprobs[i], expected, atol=1e-5)


@needs_torchvision
def test_the_stand_in_processor_is_the_real_one_for_images():
    """The stand-in the torchvision-free tests use gives the real Qwen processor's tokens and patches."""
    path = qwen_checkpoint("qwen2_5_vl")
    real = LVLMJudge.shared(JudgeSpec(path)).processor
    chat = LVLMJudge.shared(JudgeSpec(path)).chat(fleur_instruction(CAPTIONS[0]))
    ours = QwenProcessorStandIn(path)(text=[chat], images=[images()[1]])
    theirs = real(text=[chat], images=[images()[1]], return_tensors="pt")
    for key in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw"):
        assert torch.equal(ours[key], theirs[key]), key
    if "mm_token_type_ids" in theirs:
        assert torch.equal(ours["mm_token_type_ids"], theirs["mm_token_type_ids"].to(ours["mm_token_type_ids"].dtype))


def test_missing_torchvision_is_a_clear_error():
    from conftest import torchvision_works

    if torchvision_works():
        pytest.skip("torchvision is installed")
    with pytest.raises(ImportError, match=r"needs torchvision.*-e '\.\[qwen\]") as error:
        LVLMJudge.shared(JudgeSpec(qwen_checkpoint("qwen2_vl")))
    assert "\n" not in str(error.value)


# --- system prompt and image aspect ------------------------------------------------------------------------------

LLAVA_V1 = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives "
            "helpful, detailed, and polite answers to the human's questions.")


def test_system_prompt_on_llava_1_5_is_the_official_llava_v1_conversation():
    """The llava-hf LLaVA-1.5 template with a system turn writes exactly what LLaVA's conv_templates["llava_v1"]
    .get_prompt() does for one image and one question: "{system} USER: <image>\\n{question} ASSISTANT:"."""
    from capeval_plugins.models.lvlm import LLAVA_V1_SYSTEM, VisualInput
    from capeval_plugins.testing import tiny_checkpoint

    assert LLAVA_V1_SYSTEM == LLAVA_V1
    judge = LVLMJudge.shared(JudgeSpec(str(tiny_checkpoint("llava"))))
    question = fleur_instruction(CAPTIONS[0])
    for placement in ("auto", "system"):
        chat = judge.chat(question, images()[0], VisualInput(system_prompt=LLAVA_V1, system_placement=placement))
        assert chat == f"{LLAVA_V1} USER: <image>\n{question} ASSISTANT:"
    assert judge.chat(question, images()[0]) == f"USER: <image>\n{question} ASSISTANT:"


def test_a_template_without_a_system_turn_gets_the_system_prompt_in_the_user_turn(monkeypatch):
    from capeval_plugins.models.lvlm import VisualInput
    from capeval_plugins.testing.vision_language import MISTRAL_LLAVA_TEMPLATE

    judge = LVLMJudge.shared(JudgeSpec(sharp_llava()))
    # llava-hf's LLaVA-NeXT (Mistral) template has a Llama-2 style <<SYS>> block: "auto" uses it
    with_block = judge.chat("Rate it.", images()[0], VisualInput(system_prompt="Be brief."))
    assert with_block == "<<SYS>>\nBe brief.\n<</SYS>>\n\n[INST] <image>\nRate it. [/INST]"
    forced = judge.chat("Rate it.", images()[0], VisualInput(system_prompt="Be brief.", system_placement="user"))
    assert forced == "[INST] <image>\nBe brief.\n\nRate it. [/INST]"
    # A Mistral-style template that rejects a system turn: "auto" falls back to the user turn, "system" refuses.
    strict = MISTRAL_LLAVA_TEMPLATE.replace("{% if message['role'] == 'system' %}",
                                            "{% if message['role'] == 'system' %}{{ raise_exception('no system') }}")
    processor = type(judge.processor).from_pretrained(sharp_llava())
    processor.chat_template = strict
    strict_judge = LVLMJudge(judge.model, processor)
    assert strict_judge.chat("Rate it.", images()[0], VisualInput(system_prompt="Be brief.")) == forced
    with pytest.raises(ValueError, match="no system turn"):
        strict_judge.chat("Rate it.", images()[0], VisualInput(system_prompt="Be brief.", system_placement="system"))
    # A template that silently drops the system text counts as having no system turn.
    processor.chat_template = MISTRAL_LLAVA_TEMPLATE.replace("message['content'][0]['text']", "''")
    assert LVLMJudge(judge.model, processor).chat("Rate it.", images()[0],
                                                 VisualInput(system_prompt="Be brief.")) == forced


def test_padding_to_a_square_is_llavas_expand2square():
    from PIL import Image

    from capeval_plugins.models.lvlm import VisualInput, pad_to_square

    mean = (0.48145466, 0.4578275, 0.40821073)
    for size in ((40, 28), (27, 40), (33, 33)):
        image = random_image(sum(size), size=size)
        width, height = image.size
        side = max(width, height)
        expected = Image.new("RGB", (side, side), tuple(int(x * 255) for x in mean))  # LLaVA's expand2square
        expected.paste(image, ((side - width) // 2, (side - height) // 2))
        assert (pad_to_square(image, mean) == np.asarray(expected)).all()
    # What the processor makes of the padded image is what it makes of LLaVA's padded PIL image, at every size:
    # a 1, 3 or 4 pixel square as an array was read channels first (a 4 x 4 image scored as another)
    judge = LVLMJudge.shared(JudgeSpec(sharp_llava()))
    for image in (images()[2], *(random_image(k, size=size) for k, size in enumerate(
            ((1, 1), (3, 3), (4, 4), (3, 1), (1, 3), (4, 2), (5, 2))))):
        padded = judge._visual_kwargs(image, VisualInput(image_aspect="pad"))["images"][0]
        side = max(image.size)
        canvas = Image.new("RGB", (side, side), tuple(int(x * 255) for x in judge.processor.image_processor.image_mean))
        canvas.paste(image, ((side - image.size[0]) // 2, (side - image.size[1]) // 2))
        ours = judge.processor.image_processor(images=[padded], return_tensors="pt")["pixel_values"]
        theirs = judge.processor.image_processor(images=[canvas], return_tensors="pt")["pixel_values"]
        assert torch.equal(ours, theirs), image.size
    with pytest.raises(ValueError, match="image_aspect"):
        VisualInput(image_aspect="stretch")
    with pytest.raises(ValueError, match="system_placement"):
        VisualInput(system_placement="assistant")


def test_the_cache_goes_through_the_supported_argument(sharp_judge, monkeypatch):
    """transformers 5.24 deprecates ``past_key_values=`` (removed in 5.40) for ``cache=``: the judge passes its
    cache under the name the model's forward declares, and never the deprecated one where ``cache`` exists."""
    import inspect

    model = sharp_judge.model
    declared = inspect.signature(model.forward).parameters
    seen: list[set[str]] = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: (seen.append(set(kw)), forward(*a, **kw))[1])
    run_judge(sharp_judge, max_new_tokens=3)
    steps = [kw for kw in seen if {"cache", "past_key_values"} & kw]
    assert steps, "the decoding steps pass a cache"
    if "cache" in declared:
        assert all("cache" in kw and "past_key_values" not in kw for kw in steps)
    else:  # transformers before 5.24
        assert all("past_key_values" in kw for kw in steps)
