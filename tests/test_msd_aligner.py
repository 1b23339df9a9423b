"""MSD-Score's local aligner on a tiny random CLIP and a tiny random LLaMA: the objectives against direct
computations, training on coloured shapes captioned by colour and shape (the loss falls, matching pairs rank
first), resumed runs end where uninterrupted ones do, the vision cache is used, a checkpoint scores through the
metrics like a plain pipeline on the same features, with batch- and order-invariant scores, and bad checkpoints
are refused."""
from __future__ import annotations

import json
import math
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import Interrupted, interrupt_at
from test_msd import plain_msd, unit

import capeval_plugins
from capeval_plugins.core import vmf
from capeval_plugins.models.encoders import EncoderSpec
from capeval_plugins.resources.loading import ModelLoadError
from capeval_plugins.inputs import InputError, to_batch
from capeval_plugins.metrics.msd import pixel_seeds
from capeval_plugins.training.msd_aligner import data as caption_data
from capeval_plugins.models.msd_aligner.model import (CONFIG_FILE, PROJECTOR_FILE, TOKENS_FILE, AlignerSettings,
                                                      LocalAligner, load_aligner, read_record, read_settings)
from capeval_plugins.training.msd_aligner.synthetic import synthetic_captions
from capeval_plugins.training.msd_aligner.train import (AlignerConfig, PatchFeatures, build_aligner,
                                                        contrastive_loss, frozen_spec, lr_factor, reconstruction_nll,
                                                        train_aligner)

FAST = dict(batch_size=12, lr=1e-2, warmup_ratio=0.0)


@pytest.fixture(scope="module")
def backbones(tiny_root) -> tuple[str, str]:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("clip", root=tiny_root)), str(tiny_checkpoint("llama", root=tiny_root))


def settings_for(backbones, **extra) -> AlignerSettings:
    """The training mechanics are checked on the token-table features (no LLM at scoring); the default, the
    official scripts' last hidden states, has its own tests."""
    extra.setdefault("text_features", "input_embeddings")
    return AlignerSettings(vision_model=backbones[0], llm=backbones[1], **extra)


@pytest.fixture(scope="module")
def trained(backbones, tmp_path_factory):
    """24 pairs (two of each colour and shape), 20 epochs of 2 steps, the vision features cached."""
    out = tmp_path_factory.mktemp("aligner")
    path = train_aligner(out, synthetic_captions(24, seed=0), settings=settings_for(backbones),
                         config=AlignerConfig(epochs=20, **FAST), cache_dir=out / "cache", progress=False)
    return path


def ranking_accuracy(aligner: LocalAligner, data) -> float:
    """Over pairs (i, j) with different captions: how often image i is closer to its own caption than to j's."""
    batch = to_batch(data.samples)
    image = aligner.encode_image_patches(aligner.pixel_values(batch.images)).pooled[batch.image_index]
    text = aligner.encode_text_tokens(data.captions).pooled
    sims = image @ text.T
    other = torch.tensor([[a != b for b in data.captions] for a in data.captions])
    return float(((sims.diag()[:, None] > sims) & other).sum() / other.sum())


# --- the objectives -------------------------------------------------------------------------------------------------


def test_contrastive_loss_equals_a_plain_computation():
    rng = np.random.default_rng(0)
    image = F.normalize(torch.tensor(rng.normal(size=(5, 7))), dim=-1)
    text = F.normalize(torch.tensor(rng.normal(size=(5, 7))), dim=-1)
    scale = torch.tensor(3.0, dtype=torch.float64)
    logits = 3.0 * image.numpy() @ text.numpy().T
    rows = [np.log(np.exp(r).sum()) - r[i] for i, r in enumerate(logits)]
    cols = [np.log(np.exp(c).sum()) - c[i] for i, c in enumerate(logits.T)]
    expected = (np.mean(rows) + np.mean(cols)) / 2
    assert float(contrastive_loss(image, text, scale)) == pytest.approx(expected, abs=1e-12)
    assert float(contrastive_loss(text, image, scale)) == pytest.approx(expected, abs=1e-12)  # symmetric
    same = image[:1].expand(5, -1)
    assert float(contrastive_loss(same, same, scale)) == pytest.approx(math.log(5), abs=1e-12)


def test_reconstruction_nll_equals_one_sequence_at_a_time(backbones):
    from transformers import AutoModelForCausalLM

    llm = AutoModelForCausalLM.from_pretrained(backbones[1]).eval()
    torch.manual_seed(0)
    prefix = torch.randn(3, 4, llm.config.hidden_size)
    ids = [[5, 9, 13], [7], [21, 22, 23, 24, 25]]
    bos = 1
    with torch.no_grad():
        batched, count = reconstruction_nll(llm, bos, prefix, ids)
        expected = 0.0
        embed = llm.get_input_embeddings()
        for row, tokens in enumerate(ids):
            sequence = torch.cat([embed(torch.tensor([bos])), prefix[row], embed(torch.tensor(tokens))])[None]
            logits = llm(inputs_embeds=sequence).logits[0]
            start = 1 + prefix.shape[1]  # the first caption token; predicted by the position before it
            log_p = torch.log_softmax(logits[start - 1:start - 1 + len(tokens)], dim=-1)
            expected -= float(log_p[torch.arange(len(tokens)), torch.tensor(tokens)].sum())
    assert count == 9
    assert float(batched) == pytest.approx(expected, rel=1e-5)


def test_learning_rate_schedule_is_transformers_cosine_with_warmup():
    from transformers import get_cosine_schedule_with_warmup

    total, ratio = 40, 0.1
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    schedule = get_cosine_schedule_with_warmup(opt, math.ceil(total * ratio), total)
    for step in range(total):
        assert lr_factor(step, total, ratio) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12)
        opt.step()
        schedule.step()
    assert lr_factor(3, total, ratio, "constant") == pytest.approx(0.75)
    assert lr_factor(30, total, ratio, "constant") == 1


# --- training -------------------------------------------------------------------------------------------------------


def test_training_lowers_the_loss_and_ranks_matching_pairs_first(backbones, trained):
    record = read_record(trained)
    history = record["history"]
    assert len(history) == 20 and record["global_step"] == 40
    assert history[-1]["mean_loss"] < history[0]["mean_loss"] - 1.0
    assert history[-1]["mean_contrastive"] < history[0]["mean_contrastive"] - 1.0
    assert history[-1]["mean_reconstruction"] < history[0]["mean_reconstruction"]
    held_out = synthetic_captions(24, seed=9)  # new drawings of the same colours and shapes
    spec = EncoderSpec(backbones[0])
    untrained, _ = build_aligner(settings_for(backbones), frozen_spec(backbones[0], None, None, None, None, False),
                                 frozen_spec(backbones[1], None, None, None, None, False), seed=0)
    before, after = ranking_accuracy(untrained, held_out), ranking_accuracy(load_aligner(trained, spec), held_out)
    assert after > 0.8 and after > before + 0.2, (before, after)


def test_only_the_projector_and_temperature_train(backbones, trained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    settings = read_settings(trained)
    assert settings.vision_hidden_size == 32 and settings.llm_hidden_size == 32 and settings.vision_layer == -2
    assert settings.vision_fingerprint and settings.vocab_size == 640
    table = load_file(str(trained / TOKENS_FILE))["weight"]
    llm = AutoModelForCausalLM.from_pretrained(backbones[1])
    assert torch.equal(table, llm.get_input_embeddings().weight)  # the frozen LLM's own table, unchanged
    record = read_record(trained)
    assert record["logit_scale"] != pytest.approx(1 / 0.07)  # learned
    assert record["config"]["learn_temperature"] and record["train_samples"] == 24


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(backbones, tmp_path):
    from safetensors.torch import load_file

    data = synthetic_captions(20, seed=1)
    config = AlignerConfig(epochs=2, batch_size=8, lr=1e-2, save_every=2)  # 3 steps per epoch
    cache = tmp_path / "cache"
    whole = train_aligner(tmp_path / "whole", data, settings=settings_for(backbones), config=config,
                          cache_dir=cache, progress=False)
    with pytest.raises(Interrupted):
        train_aligner(tmp_path / "cut", data, settings=settings_for(backbones), config=config, cache_dir=cache,
                      progress=False, on_step_end=interrupt_at(5))
    assert not (tmp_path / "cut" / CONFIG_FILE).exists()
    steps = []
    resumed = train_aligner(tmp_path / "cut", data, settings=settings_for(backbones), config=config,
                            cache_dir=cache, progress=False, on_step_end=steps.append)
    assert steps == [5, 6]  # saved after step 4: step 5 runs again
    a, b = load_file(str(whole / PROJECTOR_FILE)), load_file(str(resumed / PROJECTOR_FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_record(whole)["losses"] == read_record(resumed)["losses"]
    with pytest.raises(FileExistsError, match="different training run"):
        train_aligner(tmp_path / "cut", data, settings=settings_for(backbones),
                      config=AlignerConfig(epochs=3, batch_size=8), cache_dir=cache, progress=False)


def test_the_vision_cache_runs_the_tower_once_and_trains_alike(backbones, tmp_path, monkeypatch):
    data = synthetic_captions(10, seed=2)
    config = AlignerConfig(epochs=2, batch_size=4, lr=1e-2, shard_size=4, extract_batch_size=3)
    seen = []
    real = LocalAligner.vision_hidden

    def counting(self, pixels):
        seen.append(len(pixels))
        return real(self, pixels)

    monkeypatch.setattr(LocalAligner, "vision_hidden", counting)
    plain = train_aligner(tmp_path / "plain", data, settings=settings_for(backbones), config=config, progress=False)
    assert sum(seen) == 20  # every image, every epoch
    cached = train_aligner(tmp_path / "cached", data, settings=settings_for(backbones), config=config,
                           cache_dir=tmp_path / "cache", progress=False)
    assert sum(seen) == 30  # once
    assert len(list(tmp_path.glob("cache/*/shard-*.safetensors"))) == 3
    again = train_aligner(tmp_path / "again", data, settings=settings_for(backbones), config=config,
                          cache_dir=tmp_path / "cache", progress=False)
    assert sum(seen) == 30
    spec = EncoderSpec(backbones[0])
    for other in (cached, again):
        a, b = load_aligner(plain, spec).projector, load_aligner(other, spec).projector
        assert torch.allclose(a.weight, b.weight, atol=1e-5) and torch.allclose(a.bias, b.bias, atol=1e-5)
    features = PatchFeatures(load_aligner(plain, spec), data, config, tmp_path / "cache", progress=False)
    assert features.rows([7, 2]).shape == (2, 16, 32)  # 32 px, 8 px patches, class token dropped


# --- scoring --------------------------------------------------------------------------------------------------------


def plain_features(aligner: LocalAligner, image, caption: str) -> dict:
    """One pair's features computed directly: the CLIP tower's penultimate hidden state through the projector
    weights, the token table rows of the caption's content tokens."""
    encoder = aligner.encoder
    pixels = encoder.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        hidden = encoder.model.vision_model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][0, 1:]
        patches = hidden @ aligner.projector.weight.T + aligner.projector.bias
    ids = aligner.tokenizer(caption)["input_ids"][1:]  # BOS dropped; LLaMA adds no EOS
    tokens = aligner.token_table[torch.tensor(ids)]
    p, t = unit(patches), unit(tokens)
    return {"patches": p, "tokens": t, "image_global": p.mean(0) / np.linalg.norm(p.mean(0)),
            "text_global": t.mean(0) / np.linalg.norm(t.mean(0)), "image_seed": int(pixel_seeds(pixels)[0]),
            "text_seed": int(vmf.content_seeds(torch.tensor(ids)[None])[0])}


def scored_pairs():
    data = synthetic_captions(6, seed=3)
    images = [src.load() for src in data.samples.images]
    captions = list(data.captions)
    captions[1] = "a blue circle next to a red square"  # a longer one, another length
    return [images[i] for i in (0, 0, 1, 2, 3, 4)], [captions[i] for i in (0, 1, 1, 2, 3, 4)]


def test_scores_with_the_aligner_equal_a_plain_pipeline(backbones, trained):
    images, captions = scored_pairs()
    result = capeval_plugins.load("msd_score", model=backbones[0], aligner=str(trained))(images, captions)
    assert result.corpus_extras["features"] == "aligner"
    aligner = LocalAligner.shared(trained, EncoderSpec(backbones[0]))
    rows = [plain_msd(plain_features(aligner, i, c)) for i, c in zip(images, captions)]
    for key in ("cosine", "kl_image_text", "kl_text_image", "n_tokens"):
        assert result.extras[key].tolist() == pytest.approx([r[key] for r in rows], abs=1e-5), key
    assert result.scores.tolist() == pytest.approx([r["msd"] for r in rows], abs=1e-5)
    stock = capeval_plugins.load("msd_score", model=backbones[0])(images, captions)
    assert stock.corpus_extras["features"] == "stock"
    assert (stock.scores - result.scores).abs().min() > 1e-3


def test_aligner_scores_do_not_depend_on_batching_or_order(backbones, trained):
    images, captions = scored_pairs()
    base = capeval_plugins.load("soft_msd", model=backbones[0], aligner=str(trained))(images, captions)
    assert base.extras["group_size"].tolist() == [2, 2, 1, 1, 1, 1]
    for batch_size in (1, 2, 4):
        other = capeval_plugins.load("soft_msd", model=backbones[0], aligner=str(trained),
                                     batch_size=batch_size)(images, captions)
        assert other.scores.tolist() == pytest.approx(base.scores.tolist(), abs=1e-6)
    order = list(range(len(captions)))
    random.Random(0).shuffle(order)
    shuffled = capeval_plugins.load("soft_msd", model=backbones[0], aligner=str(trained), batch_size=4)(
        [images[i] for i in order], [captions[i] for i in order])
    assert shuffled.scores.tolist() == pytest.approx([base.scores[i].item() for i in order], abs=1e-6)


def test_last_hidden_text_features_read_the_llm(backbones, tmp_path):
    from transformers import AutoModelForCausalLM

    path = train_aligner(tmp_path / "hidden", synthetic_captions(12, seed=4),
                         settings=settings_for(backbones, text_features="last_hidden"),
                         config=AlignerConfig(epochs=1, **FAST), progress=False)
    assert not (path / TOKENS_FILE).exists()
    aligner = LocalAligner.shared(path, EncoderSpec(backbones[0]))
    llm = AutoModelForCausalLM.from_pretrained(backbones[1]).eval()
    caption = "a green triangle"
    ids = aligner.tokenizer(caption, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = F.normalize(llm.model(input_ids=ids).last_hidden_state[0, 1:], dim=-1)
    got = aligner.encode_text_tokens([caption, "a red circle on the grass"])
    n = int(got.mask[0].sum())
    assert torch.allclose(got.local[0][got.mask[0]], expected[:n], atol=1e-5)
    images, captions = scored_pairs()
    result = capeval_plugins.load("msd_score", model=backbones[0], aligner=str(path))(images, captions)
    assert torch.isfinite(result.scores).all()


def test_default_text_features_are_the_official_scripts_and_raw_pooling_is_theirs(backbones):
    """The default text side is the frozen LLM's last hidden states of the caption alone (BOS, EOS, padding
    dropped), as MSD-Score's caparena.py / docent.py take them; text_pooling="raw" is their global embedding, the
    normalised mean of the raw hidden states over every non-padding position with BOS kept."""
    import dataclasses

    settings = AlignerSettings(vision_model=backbones[0], llm=backbones[1])
    assert (settings.text_features, settings.text_pooling) == ("last_hidden", "content")
    assert AlignerSettings.from_dict({"text_features": "input_embeddings"}).text_pooling == "content"  # old files
    with pytest.raises(ValueError, match="text_pooling"):
        AlignerSettings(text_pooling="mean")
    spec = frozen_spec(backbones[0], None, None, None, None, False)
    aligner, llm = build_aligner(settings, spec, frozen_spec(backbones[1], None, None, None, None, False), seed=0)
    captions = ["a green triangle next to a red circle", "a blue square"]  # the second is padded in the batch
    content = aligner.encode_text_tokens(captions)
    aligner.settings = dataclasses.replace(aligner.settings, text_pooling="raw")
    raw = aligner.encode_text_tokens(captions)
    special = {aligner.tokenizer.bos_token_id, aligner.tokenizer.eos_token_id}
    for i, caption in enumerate(captions):
        ids = aligner.tokenizer(caption, return_tensors="pt")["input_ids"]
        assert ids[0, 0] == aligner.tokenizer.bos_token_id
        with torch.no_grad():
            hidden = llm.model(input_ids=ids).last_hidden_state[0].float()
        keep = torch.tensor([t not in special for t in ids[0].tolist()])
        tokens = F.normalize(hidden[keep], dim=-1)
        assert torch.allclose(content.local[i][content.mask[i]], tokens, atol=1e-5)
        assert torch.allclose(content.pooled[i], F.normalize(tokens.mean(0), dim=0), atol=1e-5)
        assert torch.allclose(raw.pooled[i], F.normalize(hidden.mean(0), dim=0), atol=1e-5)  # BOS included
        assert torch.allclose(raw.local[i][raw.mask[i]], tokens, atol=1e-5)  # the mixtures' tokens are the same
        assert not torch.allclose(raw.pooled[i], content.pooled[i], atol=1e-3)


def test_bad_or_incompatible_aligners_are_refused(backbones, trained, tiny_root, tmp_path):
    from safetensors.torch import load_file, save_file

    from capeval_plugins.testing import tiny_checkpoint

    images, captions = scored_pairs()
    other_clip = str(tiny_checkpoint("clip", root=tiny_root, seed=7))
    with pytest.raises(ModelLoadError, match="other weights"):
        capeval_plugins.load("msd_score", model=other_clip, aligner=str(trained))(images, captions)
    with pytest.raises(ValueError, match="patch_layernorm"):
        capeval_plugins.load("msd_score", model=backbones[0], aligner=str(trained), patch_layernorm=True)
    with pytest.raises(FileNotFoundError, match="it is no MSD aligner"):
        capeval_plugins.load("msd_score", model=backbones[0], aligner=str(tmp_path))(images, captions)
    broken = tmp_path / "broken"
    shutil.copytree(trained, broken, ignore=shutil.ignore_patterns("training_state", "cache"))
    (broken / TOKENS_FILE).unlink()
    with pytest.raises(ModelLoadError, match=TOKENS_FILE):  # every loader's failure: one typed line
        load_aligner(broken, EncoderSpec(backbones[0]))
    wide = tmp_path / "wide"
    shutil.copytree(trained, wide, ignore=shutil.ignore_patterns("training_state", "cache"))
    table = load_file(str(wide / TOKENS_FILE))["weight"]
    save_file({"weight": torch.cat([table, table], dim=1)}, str(wide / TOKENS_FILE))
    with pytest.raises(ModelLoadError, match="do not match the projector"):
        load_aligner(wide, EncoderSpec(backbones[0]))
    config = json.loads((wide / CONFIG_FILE).read_text())
    config["settings"]["llm_hidden_size"] = 64
    (wide / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="LLM hidden size 32, the config says 64"):
        load_aligner(wide, EncoderSpec(backbones[0]))


def test_an_aligner_brings_its_own_vision_backbone(backbones, trained, tmp_path, capsys):
    """Without ``model``, an aligner's metric loads the CLIP the aligner was trained on (not the paper's default
    CLIP-L), in Python and on the command line; a given ``model`` (e.g. a local copy) is used as given."""
    from capeval_plugins.cli import main

    images, captions = scored_pairs()
    own = capeval_plugins.load("soft_msd", aligner=str(trained))
    assert own.config.model == backbones[0]
    given = capeval_plugins.load("soft_msd", aligner=str(trained), model=backbones[0])(images, captions)
    assert torch.equal(own(images, captions).scores, given.scores)
    data = write_pairs(tmp_path / "images", 3)
    rows = tmp_path / "captions.jsonl"
    rows.write_text("\n".join(json.dumps({"image": f"GCC_train_{i:09d}.jpg", "caption": c})
                              for i, c in enumerate(data.captions)))
    assert main(["score", "-m", "soft_msd", "-m", "msd_score", "-o", f"aligner={trained}", "--captions", str(rows),
                 "--images", str(tmp_path / "images"), "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["metrics"]["soft_msd"]["features"] == "aligner" == summary["metrics"]["msd_score"]["features"]


# --- data and the command line --------------------------------------------------------------------------------------


def write_pairs(folder, n: int = 8):
    data = synthetic_captions(n, seed=6)
    folder.mkdir(parents=True, exist_ok=True)
    for i, src in enumerate(data.samples.images):
        src.load().save(folder / f"GCC_train_{i:09d}.jpg")
    return data


def test_reads_llava_chat_json_and_caption_records(tmp_path):
    data = write_pairs(tmp_path / "images", 3)
    chat = [{"id": f"{i:09d}", "image": f"GCC_train_{i:09d}.jpg",
             "conversations": [{"from": "human", "value": "Describe the image briefly.\n<image>"},
                               {"from": "gpt", "value": caption}]} for i, caption in enumerate(data.captions)]
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    read = caption_data.read_captions(tmp_path / "chat.json", images=tmp_path / "images")
    assert read.captions == data.captions and len(read) == 3
    assert caption_data.read_captions(tmp_path / "chat.json", images=tmp_path / "images", limit=2).captions == \
        data.captions[:2]
    lines = [json.dumps({"image": f"images/GCC_train_{i:09d}.jpg", "caption": c}) for i, c in enumerate(data.captions)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines))
    assert caption_data.read_captions(tmp_path / "pairs.jsonl").captions == data.captions
    chat[1]["conversations"] = chat[1]["conversations"][:1]
    (tmp_path / "bad.json").write_text(json.dumps(chat))
    with pytest.raises(InputError, match="record 1: no gpt or assistant turn"):
        caption_data.read_captions(tmp_path / "bad.json", images=tmp_path / "images")
    chat[1]["image"] = "missing.jpg"
    (tmp_path / "bad.json").write_text(json.dumps(chat))
    with pytest.raises(InputError, match="record 1: image not found"):
        caption_data.read_captions(tmp_path / "bad.json", images=tmp_path / "images")


def test_command_line_trains_and_scores(backbones, tmp_path, capsys):
    from capeval_plugins.cli import main

    data = write_pairs(tmp_path / "images", 8)
    chat = [{"id": str(i), "image": f"GCC_train_{i:09d}.jpg",
             "conversations": [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": c}]}
            for i, c in enumerate(data.captions)]
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    args = ["train", "msd-aligner", "--train", str(tmp_path / "chat.json"), "--images", str(tmp_path / "images"),
            "--vision-model", backbones[0], "--llm", backbones[1], "--out", str(tmp_path / "aligner"),
            "--epochs", "2", "--batch-size", "4", "--micro-batch-size", "2", "--quiet"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 4 and summary["train_samples"] == 8 and summary["text_features"] == "last_hidden"
    assert summary["text_pooling"] == "content"
    assert len(summary["history"]) == 2
    assert main([*args[:-1], "--lr", "0.1", "--quiet"]) == 2
    assert "different training run" in capsys.readouterr().err
    captions = tmp_path / "captions.jsonl"
    captions.write_text("\n".join(json.dumps({"image": f"GCC_train_{i:09d}.jpg", "caption": c})
                                  for i, c in enumerate(data.captions[:3])))
    assert main(["score", "--metric", "soft_msd", "--model", backbones[0], "-o", f"aligner={tmp_path / 'aligner'}",
                 "--captions", str(captions), "--images", str(tmp_path / "images"), "--quiet"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["n"] == 3 and scored["metrics"]["soft_msd"]["features"] == "aligner"


def test_the_vision_cache_keys_the_towers_files_not_its_first_weights(backbones, tmp_path):
    """A tower whose patch embedding is kept but whose other weights differ (a fine-tune that froze it) read
    the other tower's cached features: the key held only the patch embedding's first values."""
    import shutil

    from safetensors.torch import load_file, save_file

    data = synthetic_captions(6, seed=3)
    config = AlignerConfig(epochs=1, batch_size=3, shard_size=3, extract_batch_size=3)
    tower = tmp_path / "clip"
    shutil.copytree(backbones[0], tower)
    settings = AlignerSettings(vision_model=str(tower), llm=backbones[1], text_features="input_embeddings")

    def key() -> str:
        aligner = build_aligner(settings, EncoderSpec(str(tower)), EncoderSpec(backbones[1]), 0)[0]
        return PatchFeatures(aligner, data, config, None, progress=False).cache_key()

    first = key()
    weights = load_file(str(tower / "model.safetensors"))
    save_file({k: v if "patch_embedding" in k or not v.is_floating_point() else v * 1.5 for k, v in weights.items()},
              str(tower / "model.safetensors"), metadata={"format": "pt"})
    from capeval_plugins.resources.loading import clear_cache

    clear_cache()
    assert key() != first
