"""``capeval convert expert``: EXPERT's LoRA release (LLaVA's own format: adapter_config.json, the factors pickled
as LLaVA saves them, the trained projector in non_lora_trainables.bin) folded into a tiny LLaVA-1.5 base, checked
against the merge computed here from the released tensors; and what it refuses."""
from __future__ import annotations

import json
import warnings
from pathlib import Path
import pytest
import torch
from conftest import random_image

from capeval_plugins.metrics.expert import EXPERT


def lora_release(folder: Path, base: str, rank: int = 4, alpha: float = 8.0, **extra) -> dict:
    """A LoRA release in LLaVA's own format over the tiny LLaVA-1.5 ``base``: adapter_config.json, the factors of
    every language-model linear layer (peft's key names, pickled as LLaVA saves them) and the trained projector in
    non_lora_trainables.bin. Returns the tensors written."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(base)
    gen = torch.Generator().manual_seed(7)
    factors, projector = {}, {}
    for name, param in model.model.language_model.named_parameters():
        if name.endswith("_proj.weight"):
            layer = name[: -len(".weight")]
            factors[f"base_model.model.model.{layer}.lora_A.weight"] = torch.randn(rank, param.shape[1], generator=gen)
            factors[f"base_model.model.model.{layer}.lora_B.weight"] = torch.randn(param.shape[0], rank, generator=gen)
    for k, linear in ((0, model.model.multi_modal_projector.linear_1), (2, model.model.multi_modal_projector.linear_2)):
        for part in ("weight", "bias"):
            shape = getattr(linear, part).shape
            projector[f"base_model.model.model.mm_projector.{k}.{part}"] = torch.randn(*shape, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "fan_in_fan_out": False,
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
              "base_model_name_or_path": "liuhaotian/llava-v1.5-13b", **extra}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    torch.save(factors, folder / "adapter_model.bin")
    torch.save(projector, folder / "non_lora_trainables.bin")
    return {"factors": factors, "projector": projector}


def test_convert_expert_folds_the_lora_and_the_projector_into_the_base(tmp_path):
    """Every weight LoRA targets becomes W + (alpha / r) B A (computed here from the released factors), the
    projector is the released one, every other weight is the base's; the folder loads and scores."""
    from test_lvlm import tiny_llava15
    from transformers import LlavaForConditionalGeneration

    from capeval_plugins.commands.convert_expert import convert_expert

    base = tiny_llava15()
    released = lora_release(tmp_path / "adapter", base)
    report = convert_expert(tmp_path / "adapter", tmp_path / "out", base=base, dtype="float32")
    assert report.merged == 7 * 2 and report.scaling == 2.0 and len(report.projector) == 4
    before = dict(LlavaForConditionalGeneration.from_pretrained(base).named_parameters())
    after = dict(LlavaForConditionalGeneration.from_pretrained(tmp_path / "out").named_parameters())
    folded = set()
    for key, a in released["factors"].items():
        if ".lora_A." not in key:
            continue
        b = released["factors"][key.replace("lora_A", "lora_B")]
        name = key.replace("base_model.model.model.", "model.language_model.").replace(".lora_A.weight", ".weight")
        torch.testing.assert_close(after[name], before[name] + 2.0 * b @ a, rtol=1e-6, atol=1e-5)
        folded.add(name)
    for key, value in released["projector"].items():
        linear = "linear_1" if ".mm_projector.0." in key else "linear_2"
        name = f"model.multi_modal_projector.{linear}.{key.rsplit('.', 1)[1]}"
        assert torch.equal(after[name], value)
        folded.add(name)
    assert all(torch.equal(after[n], p) for n, p in before.items() if n not in folded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = EXPERT(model=str(tmp_path / "out"), device="cpu", max_new_tokens=4, explanation=False)(
            [random_image(1)], ["a dog"])
    assert len(result) == 1


@pytest.mark.parametrize("fault", ["unknown key", "unpaired", "projector extra", "shape", "dora", "object"])
def test_convert_expert_refuses_what_it_cannot_account_for(fault, tmp_path):
    from test_lvlm import tiny_llava15

    from capeval_plugins.commands.convert import ConversionError
    from capeval_plugins.commands.convert_expert import convert_expert

    base = tiny_llava15()
    folder = tmp_path / "adapter"
    released = lora_release(folder, base, **({"use_dora": True} if fault == "dora" else {}))
    factors, projector = released["factors"], released["projector"]
    first = next(iter(factors))
    if fault == "unknown key":
        factors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 4)
    elif fault == "unpaired":
        del factors[first.replace("lora_A", "lora_B")]
    elif fault == "projector extra":
        projector["base_model.model.model.embed_tokens.weight"] = torch.zeros(3, 3)
    elif fault == "shape":
        factors[first] = torch.zeros(4, 5)
    elif fault == "object":
        factors["note"] = "a string"  # not a tensor: refused by the safe reader
    torch.save(factors, folder / "adapter_model.bin")
    torch.save(projector, folder / "non_lora_trainables.bin")
    with pytest.raises(ConversionError) as caught:
        convert_expert(folder, tmp_path / "out", base=base, dtype="float32")
    message = str(caught.value)
    assert "adapter" in message and len(message.splitlines()) == 1, message
    assert not (tmp_path / "out").exists()
