"""VELA on a tiny release of the real architecture (Qwen2 with PEFT LoRA on q_proj / v_proj, Long-CLIP's two
positional tables on OpenAI's real BPE, a head with an aspect embedding), converted by ``capeval convert vela``,
against an independent computation one sample at a time; and the converter's refusals.

VELA's official code is not on PyPI and could not be read here, so the reference is a test fixture written from
the paper's formulas (Section 3) and the released configuration (LoRA r = 4, alpha = 16 on q_proj / v_proj, an
aspect embedding of 8, Long-CLIP-L): the LLM is the real ``peft`` LoRA wrapper on transformers' Qwen2 (unpadded,
one prompt at a time), Long-CLIP is OpenAI's CLIP code (the ``polos`` wheel's copy, as for PAC-S) with its
positional embedding added through Long-CLIP's two masks, and the head is written out in torch.
"""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from conftest import random_image

import capeval_plugins
from capeval_plugins.commands.convert import ConversionError
from capeval_plugins.commands.convert_vela import convert_vela
from capeval_plugins.models.encoders.openai_clip import OPENAI_MEAN, OPENAI_STD
from capeval_plugins.testing import official_code
from capeval_plugins.testing.corpus import caption_corpus
from capeval_plugins.testing.vela import released_vela

pytestmark = pytest.mark.filterwarnings("ignore")
PROMPT = "Judge the caption.\nReferences:\n{references}\nCaption: {candidate}\nScore:"
ASPECTS = ("desc", "rel", "flu")


@pytest.fixture(scope="module")
def modules():
    found = official_code.polos_modules()
    if found is None:
        pytest.skip("OpenAI's CLIP code (the polos 0.1.3 wheel) is not here: `make test` downloads it")
    return found


@pytest.fixture(scope="module")
def release(tmp_path_factory, modules):
    root = tmp_path_factory.mktemp("vela")
    parts = released_vela(root / "release", seed=2, bpe=official_code.bpe_path())
    (root / "prompt.txt").write_text(PROMPT)
    convert_vela(parts["regressor"], root / "vela", parts["long_clip"], llm=str(parts["qwen"]),
                 clip_tokenizer=str(parts["bpe"]), prompt=root / "prompt.txt")
    return parts, str(root / "vela")


@pytest.fixture(scope="module")
def corpus():
    """Long captions (several sentences, one past 248 CLIP tokens), 1-3 references each, an empty caption."""
    texts = caption_corpus(60, seed=9)
    candidates = [" ".join(texts[i: i + 1 + i % 4]) for i in range(0, 40, 4)] + ["", " ".join(texts) + " end"]
    images = [random_image(40 + i % 5, size=(33 + 7 * (i % 5), 41)) for i in range(len(candidates))]
    references = [texts[40 + i: 41 + i + i % 3] for i in range(len(candidates))]
    return images, candidates, references


def reference_scores(parts, modules, images, candidates, references) -> np.ndarray:
    """(N, 3) VELA scores computed one sample at a time from the released pieces."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    released = load_file(str(parts["regressor"]))
    llm = get_peft_model(AutoModel.from_pretrained(parts["qwen"]),
                         LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    lora = {k.removeprefix("llm."): v for k, v in released.items() if "lora_" in k}
    missing = set(lora) - set(llm.state_dict())
    assert not missing, missing
    llm.load_state_dict(lora, strict=False)
    llm.eval()
    tokenizer = AutoTokenizer.from_pretrained(parts["qwen"])

    state = torch.load(parts["long_clip"], weights_only=True)
    mask1 = torch.zeros(248, 1)
    mask1[:20] = 1
    res = state.pop("positional_embedding_res")
    state["positional_embedding"] = state["positional_embedding"] * mask1 + res * (1 - mask1)
    clip = official_code.openai_clip(modules, state)
    transform = official_code.torchvision_transform(32, OPENAI_MEAN, OPENAI_STD)
    w, b = released["regressor.weight"].double(), released["regressor.bias"].double()
    mode = released["mode_embedding.weight"]

    out = []
    with torch.no_grad():
        for image, cand, refs in zip(images, candidates, references):
            prompt = PROMPT.replace("{references}", "\n".join(refs)).replace("{candidate}", cand)
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            hidden = llm(input_ids=ids).last_hidden_state[0].double()
            r2c = torch.cat((hidden.mean(0), hidden[-1]))
            e_v = clip.encode_image(transform(image)[None])[0].double()
            e_c = clip.encode_text(modules.clip.tokenize([cand], context_length=248, truncate=True))[0].double()
            i2c = torch.cat(((e_v - e_c).abs(), e_v * e_c))
            out.append([torch.sigmoid(w @ torch.cat((r2c, i2c, mode[a].double())) + b).item() for a in range(3)])
    return np.asarray(out)


def test_vela_equals_an_independent_computation_one_sample_at_a_time(release, modules, corpus):
    pytest.importorskip("peft")
    parts, folder = release
    images, candidates, references = corpus
    expected = reference_scores(parts, modules, images, candidates, references)
    assert expected.std(0).min() > 1e-3  # the aspects and the samples differ
    for aspect_index, aspect in enumerate(ASPECTS):
        ours = capeval_plugins.load("vela", model=folder, aspect=aspect, batch_size=5)(images, candidates, references)
        np.testing.assert_allclose(ours.scores.numpy(), expected[:, aspect_index], atol=2e-5)
        for i, name in enumerate(ASPECTS):
            np.testing.assert_allclose(ours.extras[name].numpy(), expected[:, i], atol=2e-5)
    assert 0 < ours.scores.min() and ours.scores.max() < 1


def test_scores_do_not_depend_on_the_batch(release, corpus):
    _, folder = release
    images, candidates, references = corpus
    one = capeval_plugins.load("vela", model=folder, batch_size=1)(images, candidates, references)
    many = capeval_plugins.load("vela", model=folder, batch_size=64)(images[::-1], candidates[::-1], references[::-1])
    np.testing.assert_allclose(one.scores.numpy(), many.scores.numpy()[::-1], atol=1e-5)


@pytest.mark.parametrize("part", ["", "llm", "clip"])
def test_a_converted_folder_missing_a_tensor_never_scores(release, corpus, tmp_path, part):
    """Each of VELA's three models (head, LLM, Long-CLIP) loads whole or the run is refused in one error naming
    the tensor: never a score from a randomly initialised part."""
    import shutil

    from safetensors.torch import load_file, save_file

    from capeval_plugins.resources.loading import ModelLoadError, clear_cache

    _, folder = release
    damaged = tmp_path / "vela"
    shutil.copytree(folder, damaged)
    weights = damaged / part / "model.safetensors"
    stored = load_file(str(weights))
    name = sorted(stored)[len(stored) // 2]
    save_file({k: v for k, v in stored.items() if k != name}, str(weights), metadata={"format": "pt"})
    clear_cache()
    images, candidates, references = corpus
    with pytest.raises(ModelLoadError, match=name.split(".")[-2]):
        capeval_plugins.load("vela", model=str(damaged))(images[:2], candidates[:2], references[:2])
    clear_cache()


def test_the_conversion_accounts_for_every_tensor(release):
    import json

    parts, folder = release
    record = json.loads(open(os.path.join(folder, "conversion.json")).read())
    assert len(record["lora_folded"]) == 4 and record["lora_alpha"] == 16
    assert record["head"]["mode_embed_dim"] == 8 and record["head"]["prompt"] == PROMPT
    assert {"clip", "config.json", "conversion.json", "llm", "model.safetensors"} <= set(os.listdir(folder))


def _save(tmp_path, name, state):
    from safetensors.torch import save_file

    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def test_the_converter_refuses_what_it_cannot_account_for(release, tmp_path):
    from safetensors.torch import load_file

    parts, _ = release
    base = load_file(str(parts["regressor"]))
    common = dict(long_clip=parts["long_clip"], llm=str(parts["qwen"]), clip_tokenizer=str(parts["bpe"]))
    cases = {
        "unknown tensor": {**base, "extra.scale": torch.ones(2, 2, 2)},
        "incomplete": {k: v for k, v in base.items()
                       if not k.endswith("layers.1.self_attn.v_proj.lora_B.default.weight")},
        "do not chain": {**base, "regressor.weight": torch.ones(1, 7)},
        "one per aspect": {**base, "mode_embedding.weight": torch.ones(4, 8)},
        "do not fit": {**base,
                       "llm.base_model.model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.ones(5, 4)},
    }
    for i, (reason, state) in enumerate(cases.items()):
        with pytest.raises(ConversionError, match=reason):
            convert_vela(_save(tmp_path, f"{i}.safetensors", state), tmp_path / f"out{i}", **common)
    with pytest.raises(ConversionError, match="--long-clip"):
        convert_vela(parts["regressor"], tmp_path / "no-clip", llm=str(parts["qwen"]))
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(parts["regressor"].read_bytes()[:-100])
    with pytest.raises(ConversionError, match="not a valid safetensors"):
        convert_vela(truncated, tmp_path / "cut", **common)


def test_a_long_clip_pickle_that_would_run_code_is_refused_without_running_it(release, tmp_path):
    parts, _ = release
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buffer = io.BytesIO()
    torch.save({"positional_embedding": torch.ones(2), "x": Payload()}, buffer)
    (tmp_path / "longclip-L.pt").write_bytes(buffer.getvalue())
    with pytest.raises(ConversionError, match="refused"):
        convert_vela(parts["regressor"], tmp_path / "out", tmp_path / "longclip-L.pt", llm=str(parts["qwen"]))
    assert not marker.exists()


def test_options_requirements_and_the_longcap_arena_aspects(tmp_path, monkeypatch):
    from capeval_plugins import preflight
    from capeval_plugins.bench.benchmarks import BENCHMARKS, metric_options

    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="aspect"):
        capeval_plugins.load("vela", aspect="fluency")
    said = "; ".join(preflight.problems({"vela": capeval_plugins.load("vela")}))
    assert "vela_regressor.safetensors" in said and "capeval convert vela" in said, said
    for test in ("testa", "testb"):
        for aspect in ASPECTS:
            added = metric_options(BENCHMARKS[f"longcaparena-{test}-{aspect}"], ["vela"], [])
            assert added == [f"vela.aspect={aspect}"]
    assert metric_options(BENCHMARKS["longcaparena-testa-rel"], ["vela"], ["vela.aspect=flu"]) == ["vela.aspect=flu"]
    from capeval_plugins.bench import reproduce as rp  # `capeval reproduce` builds each column's metric so

    entry = next(v.entry for v in rp.load_published() if v.entry.id == "vela")
    assert not entry.external and rp.build(entry, "longcaparena-testb-rel", []).config.aspect == "rel"


def test_the_cli_choices_are_the_heads():
    from capeval_plugins.commands import convert_vela as cli
    from capeval_plugins.models.encoders import vela

    assert cli.ACTIVATIONS == vela.ACTIVATIONS and cli.OUTPUTS == vela.OUTPUTS
