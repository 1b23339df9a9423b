"""The ``rigel`` metric and the one-pass scorer under it (:meth:`LVLMJudge.prompt_end`) on tiny random LVLMs:
equal to transformers' own forward pass one prompt at a time (LLaVA-NeXT; Qwen2-VL, Qwen2.5-VL and Qwen3-VL
images and videos through their real processors where torchvision imports, and through a stand-in
everywhere), gradients through the shared prefix equal
to the plain forward's, scores equal to an independent computation from the checkpoint's files, prompts per
sample (image / video, with / without references), and the clear error without a checkpoint."""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from conftest import needs_torchvision, random_image

import capeval_plugins
from capeval_plugins.models.lvlm import JudgeSpec, LVLMJudge, VisualInput
from capeval_plugins.inputs import InputError
from capeval_plugins.testing import scratch_folder
from capeval_plugins.models.rigel import (LABELS, RigelSettings, load_private_backbone, paper_prompts,
                                          render_prompt)
from capeval_plugins.training.checkpoint import save_checkpoint

CAPTIONS = ["A dog runs on the grass.", "Two children play in the park!", "A red car next to a building",
            "a cat", "An old man sits on a bench under a tree."]
REFERENCES = [["A dog on grass.", "A brown dog."], ["Kids in a park."], ["A car."], ["A cat sleeps."],
              ["A man on a bench.", "An old man."]]
IMAGE_OF = [0, 0, 1, 2, 1]


def images():
    return [random_image(i, size=(40 + 8 * i, 36 + 4 * i)) for i in range(3)]


def video(seed: int, frames: int = 3):
    return [random_image(seed * 10 + j, size=(40, 36)) for j in range(frames)]


@lru_cache(maxsize=None)
def llava() -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("llava_next"))


@lru_cache(maxsize=None)
def checkpoint() -> str:
    """A Rigel checkpoint on the tiny LLaVA-NeXT: a random head (phase 1 format, no adapter)."""
    settings = RigelSettings(base_model=llava(), hidden_size=32, head_hidden=(16,), phase=1)
    torch.manual_seed(0)
    head = settings.build_head()
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(4)  # distributions that differ visibly between samples
    return str(save_checkpoint(str(scratch_folder("capeval-rigel-ckpt-")), settings, head))


def plain_forward(model, processor, chat: str, visual) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers alone: one prompt, one forward pass; (final hidden state, label log-probabilities) at its
    last position."""
    frames = visual if isinstance(visual, list) else [visual]
    enc = processor(text=[chat], images=frames, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    ids = [processor.tokenizer.convert_tokens_to_ids(label) for label in LABELS]
    return out.hidden_states[-1][0, -1], torch.log_softmax(out.logits[0, -1].float(), -1)[ids]


def independent_scores(visuals, candidates, references=None, head: str = "scoring") -> torch.Tensor:
    """The checkpoint's files read by hand: prompt, chat template, one forward pass per sample, the MLP from the
    safetensors weights, expectation over 1..5 normalised to [0, 1]."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(llava()).eval()
    processor = AutoProcessor.from_pretrained(llava())
    w = load_file(str(Path(checkpoint()) / "head.safetensors"))
    prompts = paper_prompts()
    out = []
    for i, (visual, candidate) in enumerate(zip(visuals, candidates)):
        refs = references[i] if references else None
        key = ("video" if isinstance(visual, list) else "image") + ("_ref" if refs else "")
        text = prompts[key].replace("{refs_text}", "\n".join(refs or [])).replace("{cand}", candidate)
        slots = len(visual) if isinstance(visual, list) else 1
        content = [{"type": "image"}] * slots + [{"type": "text", "text": text}]
        chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        h, label_logprobs = plain_forward(model, processor, chat, visual)
        hidden = torch.relu(h @ w["net.0.weight"].T + w["net.0.bias"])
        probs = torch.softmax((hidden @ w["net.2.weight"].T + w["net.2.bias"]).double(), -1)
        if head == "lm":  # the LM head's label tokens, renormalised over the five labels
            probs = label_logprobs.double().exp() / label_logprobs.double().exp().sum()
        out.append(((probs * torch.arange(1, 6, dtype=torch.float64)).sum() - 1) / 4)
    return torch.stack(out)


# --- the one-pass scorer ------------------------------------------------------------------------------------------


def test_prompt_end_equals_one_forward_pass_per_prompt():
    judge = LVLMJudge.shared(JudgeSpec(llava()))
    ins = [render_prompt(paper_prompts()["image"], c) for c in CAPTIONS]
    out = judge.prompt_end(images(), IMAGE_OF, ins, LABELS, batch_size=5)
    for i in range(len(CAPTIONS)):
        h, logp = plain_forward(judge.model, judge.processor, judge.chat(ins[i]), images()[IMAGE_OF[i]])
        assert torch.allclose(out.hidden[i], h, atol=1e-5)
        assert torch.allclose(out.label_logprobs[i], logp, atol=1e-5)
    for batch_size in (1, 2):
        other = judge.prompt_end(images(), IMAGE_OF, ins, LABELS, batch_size=batch_size)
        assert torch.allclose(other.hidden, out.hidden, atol=1e-5)
    # the label distribution is the LM head's label rows times the hidden state
    weight, _ = judge.lm_head_rows(judge.label_table(LABELS)[0])
    assert torch.allclose(torch.log_softmax(out.hidden @ weight.T, -1), torch.log_softmax(out.label_logprobs, -1),
                          atol=1e-5)
    assert judge.prompt_end([], [], [], LABELS).hidden.shape == (0, 32)


def test_a_video_is_its_frames_as_images_on_llava_next():
    judge = LVLMJudge.shared(JudgeSpec(llava()))
    visuals = [video(1), images()[0], video(2, frames=2)]
    ins = [render_prompt(paper_prompts()["video"], "A dog runs."), render_prompt(paper_prompts()["image"], "A cat."),
           render_prompt(paper_prompts()["video"], "Two kids.")]
    out = judge.prompt_end(visuals, [0, 1, 2], ins, LABELS)
    assert judge.video_mode(VisualInput()) == "frames"
    for i, visual in enumerate(visuals):
        chat = judge.chat(ins[i], visual)
        assert chat.count("<image>") == (len(visual) if isinstance(visual, list) else 1)
        h, logp = plain_forward(judge.model, judge.processor, chat, visual)
        assert torch.allclose(out.hidden[i], h, atol=1e-5) and torch.allclose(out.label_logprobs[i], logp, atol=1e-5)
    with pytest.raises(ValueError, match="no video input"):
        judge.chat("x", video(1), VisualInput(video="video"))


def test_gradients_through_the_shared_prefix_equal_the_plain_forward_ones():
    from transformers import AutoProcessor

    model = load_private_backbone(JudgeSpec(llava()))
    target = model.model.language_model.layers[0].self_attn.v_proj.weight
    target.requires_grad_(True)
    judge = LVLMJudge(model, AutoProcessor.from_pretrained(llava()))
    ins = [render_prompt(paper_prompts()["image"], c) for c in CAPTIONS]
    direction = torch.randn(len(CAPTIONS), 32, generator=torch.Generator().manual_seed(0))
    out = judge.prompt_end(images(), IMAGE_OF, ins, LABELS, grad=True)
    assert out.hidden.requires_grad
    (out.hidden * direction).sum().backward()
    batched = target.grad.clone()
    target.grad = None
    for i in range(len(CAPTIONS)):
        enc = judge.processor(text=[judge.chat(ins[i])], images=[images()[IMAGE_OF[i]]], return_tensors="pt")
        hidden = model(**enc, output_hidden_states=True).hidden_states[-1][0, -1]
        (hidden * direction[i]).sum().backward()
    assert batched.abs().max() > 0
    assert torch.allclose(batched, target.grad, atol=1e-5, rtol=1e-4)


class QwenStandIn:
    """What Qwen2-VL's processor does, without its video processor (which needs torchvision): each
    <|image_pad|> becomes grid_t * grid_h * grid_w / merge^2 copies, and a video of T frames (T even) is T / 2
    temporal patches, each here the image processor's patches of the pair's first frame; mm_token_type_ids
    marks image (1) and video (2) tokens."""

    image_token, video_token = "<|image_pad|>", "<|video_pad|>"

    def __init__(self, path: str):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path)
        self.video_processor = self.image_processor  # stands for "has a video input"

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def _expand(self, text: str, token: str, counts: list[int]) -> str:
        it = iter(counts)
        return re.sub(re.escape(token), lambda _m: "\0" * next(it), text).replace("\0", token)

    def __call__(self, text, images=None, videos=None, return_tensors="pt", **kwargs):
        merge = self.image_processor.merge_size ** 2
        out, texts = {}, list(text)
        if images:
            vision = self.image_processor(images=images, return_tensors="pt")
            out.update(vision)
            counts = (vision["image_grid_thw"].prod(-1) // merge).tolist()
            texts = [self._expand(t, self.image_token, counts) for t in texts]
        if videos:
            patches, grids = [], []
            for frames in videos:
                pairs = [self.image_processor(images=[f], return_tensors="pt") for f in frames[::2]]
                patches += [p["pixel_values"] for p in pairs]
                grid = pairs[0]["image_grid_thw"][0].clone()
                grid[0] = len(pairs)
                grids.append(grid)
            out["pixel_values_videos"], out["video_grid_thw"] = torch.cat(patches), torch.stack(grids)
            texts = [self._expand(t, self.video_token, [int(g.prod()) // merge for g in grids]) for t in texts]
        enc = self.tokenizer(texts, return_tensors="pt", add_special_tokens=kwargs.get("add_special_tokens", True))
        ids = enc["input_ids"]
        types = (ids == self.tokenizer.convert_tokens_to_ids(self.image_token)).long()
        types[ids == self.tokenizer.convert_tokens_to_ids(self.video_token)] = 2
        return {**enc, "mm_token_type_ids": types, **out}


@lru_cache(maxsize=None)
def qwen(kind: str) -> str:
    from capeval_plugins.testing import build_tiny

    path = str(scratch_folder(f"capeval-rigel-{kind}-"))
    try:
        build_tiny(kind, path)
    except RuntimeError:  # no torchvision: model, tokenizer and image processor are saved, not the processor
        pass
    return path


def video_kwargs(frames: list, fps: float = 2.0) -> dict:
    """A video for a Qwen processor as the judge feeds it: the frames as given, ``fps`` their sampling rate."""
    return {"videos": [frames], "do_sample_frames": False,
            "video_metadata": [{"total_num_frames": len(frames), "fps": fps, "frames_indices": list(range(len(frames)))}]}


# The stand-in mimics Qwen2-VL's video prompt; Qwen3-VL's (timestamps between frame groups) only the real one has.
QWEN_CASES = [(kind, visual, processor) for kind, visual in [("qwen3_vl", "image"), ("qwen2_vl", "video"),
                                                             ("qwen2_vl", "mixed"), ("qwen2_5_vl", "mixed")]
              for processor in ("stand-in", "real")] + [("qwen3_vl", "video", "real")]


@pytest.mark.parametrize("kind, visual, processor", [
    pytest.param(*case, marks=needs_torchvision) if case[2] == "real" else case for case in QWEN_CASES])
def test_qwen_families_equal_their_own_forward_pass(kind, visual, processor):
    from transformers import AutoModelForImageTextToText

    if processor == "real":  # the user's path: the checkpoint's own processor
        judge = LVLMJudge.shared(JudgeSpec(qwen(kind)))
        model, processor = judge.model, judge.processor
    else:
        model = AutoModelForImageTextToText.from_pretrained(qwen(kind)).eval()
        processor = QwenStandIn(qwen(kind))
        judge = LVLMJudge(model, processor)
    visuals = {"image": images()[:2], "video": [video(1, 4), video(2, 2)], "mixed": [video(1, 4), images()[1]]}[visual]
    index = [0, 0, 1, 1]
    ins = [render_prompt(paper_prompts()["video" if isinstance(visuals[g], list) else "image"], c)
           for g, c in zip(index, CAPTIONS)]
    out = judge.prompt_end(visuals, index, ins, LABELS, batch_size=4)  # a mixed chunk: images and videos
    one = judge.prompt_end(visuals, index, ins, LABELS, batch_size=1)
    assert torch.allclose(out.hidden, one.hidden, atol=1e-5)
    assert judge.video_mode(VisualInput()) == "video"
    label_ids = [processor.tokenizer.convert_tokens_to_ids(label) for label in LABELS]
    for i in (1, 2):
        v = visuals[index[i]]
        chat = judge.chat(ins[i], v)
        assert ("<|video_pad|>" in chat) == isinstance(v, list)
        enc = processor(text=[chat], return_tensors="pt", **(video_kwargs(v) if isinstance(v, list) else {"images": [v]}))
        with torch.no_grad():
            plain = model(**enc, output_hidden_states=True)
        assert torch.allclose(out.hidden[i], plain.hidden_states[-1][0, -1], atol=1e-5)
        assert torch.allclose(out.label_logprobs[i], torch.log_softmax(plain.logits[0, -1], -1)[label_ids], atol=1e-5)


@needs_torchvision
def test_rigel_on_qwen3_vl_with_its_real_processor_equals_an_independent_computation():
    """The paper's backbone family end to end: a checkpoint on a tiny Qwen3-VL, images and a video (the video
    processor, timestamps at 2 fps), scored by the metric and by hand from the checkpoint's files."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base = qwen("qwen3_vl")
    settings = RigelSettings(base_model=base, hidden_size=32, head_hidden=(16,), phase=1)
    torch.manual_seed(1)
    head = settings.build_head()
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(4)
    ckpt = save_checkpoint(str(scratch_folder("capeval-rigel-qwen3-")), settings, head)
    visuals = [images()[0], video(3, 4), images()[1]]
    captions = ["A dog runs.", "Two kids play.", "A red car."]
    result = capeval_plugins.load("rigel", checkpoint=str(ckpt), batch_size=2)(visuals, captions)

    model = AutoModelForImageTextToText.from_pretrained(base).eval()
    processor = AutoProcessor.from_pretrained(base)
    w = load_file(str(Path(ckpt) / "head.safetensors"))
    expected = []
    for visual, caption in zip(visuals, captions):
        is_video = isinstance(visual, list)
        text = render_prompt(paper_prompts()["video" if is_video else "image"], caption)
        content = [{"type": "video" if is_video else "image"}, {"type": "text", "text": text}]
        chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        enc = processor(text=[chat], return_tensors="pt", **(video_kwargs(visual) if is_video else {"images": [visual]}))
        with torch.no_grad():
            h = model(**enc, output_hidden_states=True).hidden_states[-1][0, -1]
        probs = torch.softmax((torch.relu(h @ w["net.0.weight"].T + w["net.0.bias"]) @ w["net.2.weight"].T
                               + w["net.2.bias"]).double(), -1)
        expected.append(((probs * torch.arange(1, 6, dtype=torch.float64)).sum() - 1) / 4)
    assert torch.allclose(result.scores, torch.stack(expected), atol=1e-5)


# --- the metric -----------------------------------------------------------------------------------------------------


def test_rigel_needs_a_checkpoint():
    with pytest.raises(ValueError, match="capeval train rigel"):
        capeval_plugins.load("rigel")
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        capeval_plugins.load("rigel", checkpoint="/nonexistent/rigel")
    info = capeval_plugins.load("rigel", checkpoint=checkpoint()).info
    assert info.video and info.references == "optional" and info.score_range == (0.0, 1.0)


def test_scores_equal_an_independent_computation_from_the_checkpoint_files():
    imgs = [images()[g] for g in IMAGE_OF]
    metric = capeval_plugins.load("rigel", checkpoint=checkpoint(), batch_size=3)
    free = metric(imgs, CAPTIONS)
    assert torch.allclose(free.scores, independent_scores(imgs, CAPTIONS), atol=1e-5)
    with_refs = metric(imgs, CAPTIONS, REFERENCES)
    assert torch.allclose(with_refs.scores, independent_scores(imgs, CAPTIONS, REFERENCES), atol=1e-5)
    assert (with_refs.scores - free.scores).abs().max() > 1e-4  # the reference-based prompt is another prompt
    dist = free.extras["distribution"]
    assert dist.shape == (5, 5) and torch.allclose(dist.sum(-1), torch.ones(5, dtype=torch.float64))
    assert torch.allclose(free.extras["expected_label"], 1 + 4 * free.scores)
    assert free.score == pytest.approx(float(free.scores.mean()))
    # batching plays no part
    again = capeval_plugins.load("rigel", checkpoint=checkpoint(), batch_size=1)(imgs, CAPTIONS)
    assert torch.allclose(again.scores, free.scores, atol=1e-6)


def test_videos_and_images_score_in_one_call():
    visuals = [video(1), images()[0], video(2, frames=2), images()[0]]
    captions = ["A dog runs.", "A cat.", "Two kids play.", "A red car."]
    result = capeval_plugins.load("rigel", checkpoint=checkpoint())(visuals, captions)
    assert torch.allclose(result.scores, independent_scores(visuals, captions), atol=1e-5)
    with pytest.raises(InputError, match="sample 0: video has no frames"):
        capeval_plugins.load("rigel", checkpoint=checkpoint())([[]], ["x"])


def test_the_lm_head_ablation_equals_the_label_tokens_distribution():
    imgs = [images()[g] for g in IMAGE_OF]
    result = capeval_plugins.load("rigel", checkpoint=checkpoint(), head="lm", batch_size=3)(imgs, CAPTIONS)
    assert torch.allclose(result.scores, independent_scores(imgs, CAPTIONS, head="lm"), atol=1e-5)
    scoring = capeval_plugins.load("rigel", checkpoint=checkpoint())(imgs, CAPTIONS)
    assert (result.scores - scoring.scores).abs().max() > 1e-4
    with pytest.raises(ValueError, match="head"):
        capeval_plugins.load("rigel", checkpoint=checkpoint(), head="random")
