"""Sharded and offloaded backbones (``device_map``, ``max_memory``, ``offload_folder``) on CPU: a tiny LLaVA-NeXT
with some decoder layers in CPU memory and the rest (with the final norm and the LM head) on disk scores like
the same model loaded whole, through the batched judge (prefix reuse, KV cache, greedy decoding, hidden
states, LM-head rows) and the metrics on it (FLEUR, DISCODE closed form and numeric solver, Rigel); the
placement options reach every metric and the command line, and one placement is one shared model."""
from __future__ import annotations

import pytest
import torch
import test_fleur_discode
from test_fleur_discode import ANSWERS, sample_images
from test_lvlm import CAPTIONS, DECIMAL, IMAGE_OF, images, sharp_llava
from test_rigel_metric import checkpoint as rigel_checkpoint

import capeval_plugins
from capeval_plugins.resources import loading
from capeval_plugins.models.lvlm import JudgeSpec, LVLMJudge, fleur_instruction

pytest.importorskip("accelerate")
answers = test_fleur_discode.answers  # the fixture that makes the judge answer given texts (teacher forcing)
pytestmark = pytest.mark.filterwarnings("ignore:The following device_map keys do not match")

# The vision side, the embeddings and decoder layer 0 in CPU memory; layer 1, the final norm and the LM head on
# disk: their weights sit on the meta device between forward passes and are read from the checkpoint's files.
CPU_AND_DISK = {
    "model.vision_tower": "cpu", "model.multi_modal_projector": "cpu", "model.image_newline": "cpu",
    "model.language_model.embed_tokens": "cpu", "model.language_model.layers.0": "cpu",
    "model.language_model.layers.1": "disk", "model.language_model.norm": "disk", "lm_head": "disk",
}


@pytest.fixture(scope="module")
def offload(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("offload"))


def placed(offload: str) -> dict:
    return {"device_map": CPU_AND_DISK, "max_memory": {"cpu": "1GiB"}, "offload_folder": offload}


def test_the_split_model_is_really_split(offload):
    judge = LVLMJudge.shared(JudgeSpec(sharp_llava(), **placed(offload)))
    model = judge.model
    assert loading.is_dispatched(model) and judge.device == torch.device("cpu")
    assert model.lm_head.weight.device.type == "meta"
    assert model.model.language_model.layers[1].mlp.down_proj.weight.device.type == "meta"
    assert model.model.language_model.layers[0].mlp.down_proj.weight.device.type == "cpu"


def test_the_judge_on_a_split_model_equals_the_whole_model(offload):
    whole = LVLMJudge.shared(JudgeSpec(sharp_llava()))
    split = LVLMJudge.shared(JudgeSpec(sharp_llava(), **placed(offload)))
    assert split.model is not whole.model
    ins = [fleur_instruction(c) for c in CAPTIONS]
    for forced in (None, ["0.85", "1.0", "0.3 (out of 1.0)", "0.0", "0.07", "0.5"]):  # greedy, teacher-forced
        a = whole.judge(images(), IMAGE_OF, ins, DECIMAL, max_new_tokens=4, batch_size=4, forced=forced)
        b = split.judge(images(), IMAGE_OF, ins, DECIMAL, max_new_tokens=4, batch_size=4, forced=forced)
        assert b.tokens.tolist() == a.tokens.tolist() and b.texts == a.texts
        assert torch.allclose(b.label_logprobs, a.label_logprobs, atol=1e-5, equal_nan=True)
        assert torch.allclose(b.hidden, a.hidden, atol=1e-5, equal_nan=True)
    end_a = whole.prompt_end(images(), IMAGE_OF, ins, DECIMAL.labels, batch_size=3)
    end_b = split.prompt_end(images(), IMAGE_OF, ins, DECIMAL.labels, batch_size=3)
    assert torch.allclose(end_b.hidden, end_a.hidden, atol=1e-5)
    assert torch.allclose(end_b.label_logprobs, end_a.label_logprobs, atol=1e-5)


def test_lm_head_rows_are_read_from_an_offloaded_head(offload):
    whole = LVLMJudge.shared(JudgeSpec(sharp_llava()))
    split = LVLMJudge.shared(JudgeSpec(sharp_llava(), **placed(offload)))
    ids = whole.label_table(DECIMAL.labels)
    rows, bias = split.lm_head_rows(ids)
    assert bias is None and rows.device == split.device and rows.shape == (1, 10, 32)
    assert torch.equal(rows, whole.lm_head_rows(ids)[0])
    assert rows.abs().sum() > 0
    assert split.model.lm_head.weight.device.type == "meta"  # offloaded again after the read


def test_metrics_on_a_split_model_score_like_the_whole_model(answers, offload):
    answers.update(zip(CAPTIONS, ANSWERS))
    imgs = sample_images()
    options = [("fleur", {}), ("discode", {"alpha_scale": "unit"}),
               ("discode", {"divergence": "js"})]  # no closed form: Adam on the LM-head rows and hidden states
    for name, extra in options:
        whole = capeval_plugins.load(name, model=sharp_llava(), batch_size=4, **extra)(imgs, CAPTIONS)
        split = capeval_plugins.load(name, model=sharp_llava(), batch_size=4, **placed(offload), **extra)
        split = split(imgs, CAPTIONS)
        assert torch.isfinite(whole.scores).all()
        assert torch.allclose(split.scores, whole.scores, atol=1e-6), (name, extra)
        for key, value in whole.extras.items():
            assert torch.allclose(split.extras[key], value, atol=1e-5, equal_nan=True), (name, extra, key)


def test_rigel_on_a_split_backbone_scores_like_the_whole_backbone(offload):
    imgs = [images()[g] for g in IMAGE_OF]
    whole = capeval_plugins.load("rigel", checkpoint=rigel_checkpoint(), batch_size=4)(imgs, CAPTIONS)
    split = capeval_plugins.load("rigel", checkpoint=rigel_checkpoint(), batch_size=4, device_map=CPU_AND_DISK,
                                 offload_folder=offload)
    assert split.model.judge.model.lm_head.weight.device.type == "meta"
    result = split(imgs, CAPTIONS)
    assert torch.allclose(result.scores, whole.scores, atol=1e-6)
    assert torch.allclose(result.extras["distribution"], whole.extras["distribution"], atol=1e-6)
    assert (whole.scores - whole.scores.mean()).abs().max() > 1e-4  # scores that differ between samples


def test_device_map_auto_on_a_cpu_only_machine(answers):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: 'auto' would place the model on it")
    answers.update(zip(CAPTIONS, ANSWERS))
    whole = capeval_plugins.load("discode", model=sharp_llava())(sample_images(), CAPTIONS)
    metric = capeval_plugins.load("discode", model=sharp_llava(), device_map="auto")
    auto = metric(sample_images(), CAPTIONS)
    assert metric.judge.device == torch.device("cpu") and metric.judge.model is not None
    assert torch.allclose(auto.scores, whole.scores, atol=1e-6)


def test_one_placement_is_one_shared_model(offload):
    reordered = dict(reversed(list(CPU_AND_DISK.items())))
    fleur = capeval_plugins.load("fleur", model=sharp_llava(), **placed(offload))
    discode = capeval_plugins.load("discode", model=sharp_llava(), device_map=reordered,
                                   max_memory={"cpu": "1GiB"}, offload_folder=offload + "/")
    assert discode.judge.model is fleur.judge.model  # same id, same map (any order or spelling): one copy
    other = capeval_plugins.load("discode", model=sharp_llava(), device_map=CPU_AND_DISK, offload_folder=offload)
    assert other.judge.model is not fleur.judge.model  # another max_memory: another placement
    whole = capeval_plugins.load("discode", model=sharp_llava())
    assert whole.judge.model is not fleur.judge.model


def test_placement_options_reach_every_model_backed_metric():
    from capeval_plugins import registry
    from capeval_plugins.contract import ModelConfig

    names = [n for n, e in registry.metrics().items() if e.plugin == registry.BUILTIN]
    backed = [n for n in names if issubclass(registry.get(n).cls.Config, ModelConfig)]
    assert {"clipscore", "mid", "bertscore", "fleur", "discode", "rigel", "vilbertscore", "msd_score"} <= set(backed)
    for name in backed + ["redemption_score"]:
        fields = {f for f in registry.get(name).cls.Config.__dataclass_fields__}
        assert {"device_map", "max_memory", "offload_folder"} <= fields, name


def test_an_encoder_metric_on_a_split_model(tiny_clip, offload):
    """CLIPScore with its text tower on disk equals the whole model's."""
    from conftest import CAPTIONS as CLIP_CAPTIONS
    from conftest import random_image

    imgs = [random_image(i) for i in range(4)]
    whole = capeval_plugins.load("clipscore", model=tiny_clip)(imgs, CLIP_CAPTIONS)
    split_map = {"text_model": "disk", "vision_model": "cpu", "visual_projection": "cpu", "text_projection": "disk",
                 "logit_scale": "cpu"}
    split = capeval_plugins.load("clipscore", model=tiny_clip, device_map=split_map, offload_folder=offload)
    result = split(imgs, CLIP_CAPTIONS)
    assert torch.allclose(result.scores, whole.scores, atol=1e-6)
