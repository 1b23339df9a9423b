"""Issue 49: a model or file that is not whole never gives a number. Each case failed on the code before the fix
(exit 0 with numbers, or a traceback): a model missing a tensor, another model's weights, an empty or one-tensor
file, NaN or infinite weights, a weight of another shape (1); a config.json whose sizes disagree with the weights,
refused before anything is built, a tokenizer.json past the text-file bound (2); damaged tokenizer files, crafted
safetensors names and shapes, device options no machine has (4); bounds of numeric options (6). Every model the
metrics load (CLIP, BERTScore's encoder, the LVLM judges, DINO, ViLT, ViLBERT, PAC-S, Polos, SD3, Rigel's head
and LoRA, the MSD aligner) goes through the same checks. The converters' cases are in
tests/test_convert_whole.py; the property-based mutations of whole folders in tests/test_whole_mutations.py."""
from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from conftest import cli, one_line

import capeval_plugins
from capeval_plugins.resources import loading
from capeval_plugins.resources import agreement, wholeness
from capeval_plugins.resources.loading import ModelLoadError, clear_cache

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def clip_score(model, *extra):
    return ["score", "-m", "clipscore", "-m", "refclipscore", "--model", model, "--captions",
            EXAMPLES / "captions.jsonl", "--images", EXAMPLES / "images", "--quiet", *extra]


def rewrite(folder: Path, change, name: str = "model.safetensors") -> None:
    tensors = load_file(str(folder / name))
    save_file(change(dict(tensors)), str(folder / name), metadata={"format": "pt"})


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def poisoned(name: str, value: float):
    def change(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = value
        return tensors
    return change


def without(name: str):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


# ---------------------------------------------------------------------------------------------------------
# 1. Incomplete, foreign or non-finite weights: one line naming the file and the tensor, never a number

WEIGHTS_CASES = {
    "missing text_projection": (without("text_projection.weight"), "text_projection.weight"),
    "an empty header": (lambda t: {}, "holds no tensors"),
    "one unrelated tensor": (lambda t: {"foo.weight": torch.zeros(3)}, "model.safetensors"),
    "NaN": (poisoned("text_projection.weight", float("nan")), "text_projection.weight holds NaN"),
    "inf": (poisoned("visual_projection.weight", float("inf")), "visual_projection.weight holds NaN or infinite"),
    "a weight of another shape": (lambda t: {**t, "text_projection.weight": torch.zeros(16, 33)},
                                  "text_projection.weight of shape [16, 33]"),
    "a foreign tensor inside the model": (lambda t: {**t, "text_model.extra.weight": torch.zeros(2)},
                                          "text_model.extra.weight"),
}


@pytest.mark.parametrize("case", sorted(WEIGHTS_CASES))
def test_weights_that_are_not_whole_are_refused_in_one_line(clip_copy, capsys, case):
    change, words = WEIGHTS_CASES[case]
    rewrite(clip_copy, change)
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and out == "", (case, err)
    assert words in err, (case, err)


def zero_filled_from(path: Path, fraction: float) -> None:
    """What a download cut short into a file allocated whole beforehand (aria2, hfd.sh) leaves: the header and
    the size right, zeros from where the data stopped."""
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]  # the tensors' bytes follow the header
    cut = start + int((len(data) - start) * fraction)
    data[cut:] = bytes(len(data) - cut)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_a_download_cut_short_into_a_preallocated_file_is_refused(clip_copy, capsys, fraction):
    zero_filled_from(clip_copy / "model.safetensors", fraction)
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and out == "", err
    assert "holds only zeros" in err and "model.safetensors" in err, err


def test_an_unfinished_aria2_download_beside_the_weights_is_refused(clip_copy, capsys):
    (clip_copy / "model.safetensors.aria2").write_bytes(b"\x00\x01")
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and out == "" and "not finished" in err, err


def test_a_zero_matrix_is_found_whatever_its_place_and_vectors_of_zeros_are_whole():
    """Every weight matrix is looked at, and only matrices: a trained model's biases may be zero, and so may a
    vector kept in more dimensions (DINOv2's (1, 1, width) mask token)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    torch.nn.init.zeros_(model[0].bias)
    model.register_parameter("mask_token", torch.nn.Parameter(torch.zeros(1, 1, 4)))
    assert wholeness.zeroed_problem(model, "w") is None
    torch.nn.init.zeros_(model[1].weight)
    assert "1.weight holds only zeros" in wholeness.zeroed_problem(model, "w")


def test_dinov2_loads_whole_where_dino_is_built_without_a_pooler(tmp_path):
    """The DINO encoder leaves out a pooler only where the architecture has the option: DINOv2's has none (it
    raised a TypeError), and its released mask token is zeros (the teacher never trained it)."""
    from transformers import Dinov2Config, Dinov2Model, ViTImageProcessor

    from capeval_plugins.models.encoders.common import EncoderSpec
    from capeval_plugins.models.encoders.dino import DinoEncoder

    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          image_size=32, patch_size=8)
    torch.manual_seed(0)
    Dinov2Model(config).save_pretrained(tmp_path / "dinov2")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "dinov2")
    assert not load_file(str(tmp_path / "dinov2" / "model.safetensors"))["embeddings.mask_token"].any()
    encoder = DinoEncoder(EncoderSpec(str(tmp_path / "dinov2"), device="cpu"))
    assert type(encoder.model).__name__ == "Dinov2Model"


def test_another_models_weights_are_refused(clip_copy, tiny_root, capsys):
    from capeval_plugins.testing import tiny_checkpoint

    shutil.copy(tiny_checkpoint("roberta", root=tiny_root) / "model.safetensors", clip_copy / "model.safetensors")
    capsys.readouterr()
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and out == "", err


def test_a_whole_model_with_an_extra_head_scores_as_the_whole_model(clip_copy, tiny_clip, capsys):
    """The other side: a tensor outside every module the model has (a checkpoint's task head, which transformers
    leaves out) changes no number, so it is not refused."""
    code, whole, _ = cli(clip_score(tiny_clip), capsys)
    rewrite(clip_copy, lambda t: {**t, "lm_head.weight": torch.zeros(4, 4)})
    clear_cache()
    code2, extra, err = cli(clip_score(clip_copy), capsys)
    assert code == code2 == 0, err
    assert json.loads(whole)["metrics"] == json.loads(extra)["metrics"]


def test_a_refusal_comes_before_any_sample_is_scored_whatever_on_error_says(clip_copy, capsys):
    rewrite(clip_copy, without("text_projection.weight"))
    code, out, err = cli(clip_score(clip_copy, "--on-error", "skip"), capsys)
    assert code == 2 and one_line(err) and out == "" and "text_projection.weight" in err, err


# Each family of model the metrics load: the metric, its tiny checkpoint, the tensor to damage.
FAMILIES = {
    "bertscore": ("roberta", "embeddings.word_embeddings.weight"),
    "fleur": ("llava_next", "embed_tokens.weight"),
    "vilbertscore": ("vilt", "word_embeddings.weight"),
    "pacscore": ("pacs", "text_projection.weight"),
    "polos": ("polos", "mix_gamma"),
    "msd_score": ("clip", "visual_projection.weight"),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("damage", ["missing", "nan"])
@pytest.mark.parametrize("metric", sorted(FAMILIES))
def test_every_family_of_model_is_checked_whole(metric, damage, tiny_root, tmp_path, images):
    from capeval_plugins.testing import tiny_checkpoint

    kind, tensor = FAMILIES[metric]
    folder = tmp_path / kind
    shutil.copytree(tiny_checkpoint(kind, root=tiny_root), folder)
    stored = load_file(str(folder / "model.safetensors"))
    name = next(k for k in stored if k.endswith(tensor))
    rewrite(folder, without(name) if damage == "missing" else poisoned(name, float("nan")))
    clear_cache()
    metric_object = capeval_plugins.load(metric, model=str(folder), device="cpu")
    captions = ["a dog runs on the grass", "two children play"] * 2
    references = [["a dog on grass", "a brown dog"], ["kids playing"]] * 2
    with pytest.raises(ModelLoadError, match=tensor.replace(".", r"\.")):  # by its name in the model or the file
        metric_object(images[:4], captions, references)
    clear_cache()


def test_dino_and_blip_load_whole_through_the_same_check(tiny_root, tmp_path):
    from transformers import AutoModel, BlipForImageTextRetrieval

    from capeval_plugins.testing import tiny_checkpoint

    for kind, loader, kwargs in (("dino", AutoModel, {"add_pooling_layer": False}),
                                 ("blip_itm", BlipForImageTextRetrieval, {})):
        folder = tmp_path / kind
        shutil.copytree(tiny_checkpoint(kind, root=tiny_root), folder)
        loading.load_model(loader, str(folder), device="cpu", share=False, **kwargs)  # whole: loads
        name = sorted(load_file(str(folder / "model.safetensors")))[-1]
        rewrite(folder, poisoned(name, float("inf")))
        with pytest.raises(ModelLoadError, match=name.split(".", 1)[1].replace(".", r"\.")):
            loading.load_model(loader, str(folder), device="cpu", share=False, **kwargs)


def test_a_tensor_the_caller_initialises_on_purpose_may_be_absent(clip_copy):
    from transformers import CLIPModel

    rewrite(clip_copy, without("text_projection.weight"))
    with pytest.raises(ModelLoadError, match="text_projection"):
        loading.load_model(CLIPModel, str(clip_copy), device="cpu", share=False)
    model = loading.load_model(CLIPModel, str(clip_copy), device="cpu", share=False,
                               allow_missing=(r"^text_projection\.",))
    assert model.text_projection.weight.shape == (16, 32)


def test_tied_weights_and_buffers_that_are_not_saved_load_whole(tmp_path):
    """The check's other side: a language model whose output head is its embedding table (saved once) and
    whose rotary frequencies are a buffer that is not saved loads, and scores as transformers loads it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    model = loading.load_model(AutoModelForCausalLM, str(tmp_path / "tied"), device="cpu", share=False)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "tied").eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(model(ids).logits, reference(ids).logits)
    rewrite(tmp_path / "tied", without("model.embed_tokens.weight"))  # the one copy gone: both are missing
    with pytest.raises(ModelLoadError, match="embed_tokens"):
        loading.load_model(AutoModelForCausalLM, str(tmp_path / "tied"), device="cpu", share=False)


def test_rigel_heads_and_msd_projectors_are_checked_whole(tmp_path):
    from capeval_plugins.models.rigel import HEAD_FILE, RigelSettings, load_head
    from capeval_plugins.training.checkpoint import save_checkpoint
    from capeval_plugins.models.msd_aligner.model import PROJECTOR_FILE, _tensors

    settings = RigelSettings(base_model="x", hidden_size=8, head_hidden=(4,), phase=1)
    folder = save_checkpoint(str(tmp_path / "rigel"), settings, settings.build_head())
    assert load_head(folder, settings) is not None
    rewrite(Path(folder), poisoned(sorted(load_file(str(Path(folder) / HEAD_FILE)))[0], float("nan")), HEAD_FILE)
    with pytest.raises(ModelLoadError, match="NaN"):
        load_head(folder, settings)
    aligner = tmp_path / "aligner"
    aligner.mkdir()
    save_file({"weight": torch.ones(4, 3), "bias": torch.zeros(4)}, str(aligner / PROJECTOR_FILE))
    assert set(_tensors(aligner, PROJECTOR_FILE, ("weight", "bias"))) == {"weight", "bias"}
    for broken, words in (({"weight": torch.full((4, 3), float("inf")), "bias": torch.zeros(4)}, "weight holds NaN"),
                          ({"weight": torch.ones(4, 3), "bias": torch.zeros(4), "extra": torch.ones(1)}, "extra")):
        save_file(broken, str(aligner / PROJECTOR_FILE))
        with pytest.raises(ValueError, match=words):
            _tensors(aligner, PROJECTOR_FILE, ("weight", "bias"))


# ---------------------------------------------------------------------------------------------------------
# 2. Sizes in config.json against the weights' own headers, before anything is built or allocated

CONFIG_CASES = {
    "intermediate_size 8,000,000": (("text_config", "intermediate_size"), 8_000_000, "intermediate_size = 8000000"),
    "vocab_size 20,000,000": (("text_config", "vocab_size"), 20_000_000, "vocab_size = 20000000"),
    "100,000 vision layers": (("vision_config", "num_hidden_layers"), 100_000, "num_hidden_layers = 100000"),
    "a vocabulary one larger": (("text_config", "vocab_size"), 401, "token_embedding.weight of shape [400, 32]"),
    "fewer positions": (("text_config", "max_position_embeddings"), 40, "position_embedding.weight of shape [77"),
    "another image size": (("vision_config", "image_size"), 64, "position_embedding.weight of shape [17"),
}


def test_a_config_declaring_a_layer_fewer_than_the_weights_is_refused(clip_copy, capsys):
    edit_json(clip_copy / "config.json", lambda c: c["text_config"].__setitem__("num_hidden_layers", 1))
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and "text_model.encoder.layers.1." in err and "does not declare" in err, err


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_config_whose_sizes_disagree_with_the_weights_is_refused_before_building(clip_copy, capsys, monkeypatch,
                                                                                   case):
    (section, key), value, words = CONFIG_CASES[case]
    edit_json(clip_copy / "config.json", lambda c: c[section].__setitem__(key, value))
    if value >= 100_000:  # refused from names and numbers alone: nothing is built, not even on the meta device
        monkeypatch.setattr(wholeness, "empty_model", lambda *a, **k: pytest.fail("built the model"))
    else:  # refused on the empty build at the latest: transformers never allocates the model
        from transformers import CLIPModel

        monkeypatch.setattr(CLIPModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and out == "" and words in err, (case, err)


def test_the_size_check_runs_before_any_work(clip_copy, capsys, monkeypatch):
    from capeval_plugins.session import Session

    edit_json(clip_copy / "config.json", lambda c: c["text_config"].__setitem__("vocab_size", 20_000_000))
    monkeypatch.setattr(Session, "run", lambda *a, **k: pytest.fail("started scoring"))  # the one batch loop
    code, _, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and "vocab_size = 20000000" in err, err


def test_a_missing_config_is_one_line(clip_copy, capsys):
    (clip_copy / "config.json").unlink()
    code, _, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and "config.json" in err, err


def test_real_configurations_pass_the_size_check():
    """The check's other side: configurations of real checkpoints (their sizes, with the tensor names and widest
    dimensions their weights have) are not refused: Qwen2's max_window_layers is a threshold, not a count; an
    unused sub-configuration keeps default widths below the floor."""
    weights = wholeness.Weights({f"model.layers.{i}.mlp.up_proj.weight": (18944, 3584) for i in range(28)}
                                | {"model.embed_tokens.weight": (152064, 3584)}, {})
    qwen2 = {"model_type": "qwen2", "num_hidden_layers": 28, "max_window_layers": 28, "hidden_size": 3584,
             "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 131072,
             "vision_config": {"depth": 28, "hidden_size": 3584, "embed_dim": 1280}}
    assert wholeness.config_problem(qwen2, weights) is None
    assert "max_window_layers" not in str(wholeness.config_problem({**qwen2, "max_window_layers": 80}, weights))
    assert "num_hidden_layers = 29" in wholeness.config_problem({**qwen2, "num_hidden_layers": 29}, weights)


def test_a_tokenizer_file_past_the_bound_is_refused_before_it_is_parsed(clip_copy, capsys):
    """Real tokenizer.json files weigh at most a few tens of MB (Qwen's 18.7 MB, Tekken's 19.3 MB): a sparse 200
    MB one is refused by its size, before a parser spends four times it."""
    assert loading.MAX_TEXT_FILE <= 64 * 2**20
    with open(clip_copy / "tokenizer.json", "r+b") as f:
        f.truncate(200 * 2**20)
    start = time.process_time()
    code, _, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and "tokenizer.json has" in err, err
    assert time.process_time() - start < 60  # not a timing claim: a parse of 200 MB would be minutes here


# ---------------------------------------------------------------------------------------------------------
# 4. Damaged tokenizer and weights files, device options: one line and exit 2, not a traceback

def _three_tokens(t):
    t["model"]["vocab"] = {"a": 0, "b": 1, "c": 2}
    t["model"]["merges"] = [["a", "b"]]  # a merge whose result it lacks: a panic inside tokenizers (a BaseException)


TOKENIZER_CASES = {
    "cut in half": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "an empty object": lambda p: p.write_text("{}"),
    "a 3-token vocabulary": lambda p: edit_json(p, _three_tokens),
    "nested deeply": lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
    "without merges": lambda p: edit_json(p, lambda t: t["model"].__setitem__("merges", [])),
    "half its merges": lambda p: edit_json(p, lambda t: t["model"].__setitem__("merges", t["model"]["merges"][:131])),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_CASES))
def test_a_damaged_tokenizer_is_one_line(clip_copy, capsys, case):
    TOKENIZER_CASES[case](clip_copy / "tokenizer.json")
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and out == "", (case, err)


def _image_processor(change):
    return lambda p: edit_json(p, lambda c: change(c["image_processor"]))


# The processor's config beside a whole model, damaged or of another checkpoint: each gave exit 1 and a traceback
# at the first batch (a CLIP tower takes one size only; a mean of two values fails inside the processor).
PROCESSOR_CASES = {
    "a larger crop": _image_processor(lambda c: c.update(crop_size={"height": 64, "width": 64},
                                                         size={"shortest_edge": 64})),
    "a smaller crop": _image_processor(lambda c: c.update(crop_size={"height": 16, "width": 16},
                                                          size={"shortest_edge": 16})),
    "no crop, the aspect kept": _image_processor(lambda c: c.update(do_center_crop=False)),
    "an empty image processor (224 by default)": lambda p: edit_json(p, lambda c: c.__setitem__("image_processor", {})),
    "a mean of two values": _image_processor(lambda c: c.update(image_mean=[0.5, 0.5])),
    "a standard deviation of 0": _image_processor(lambda c: c.update(image_std=[0.0, 0.0, 0.0])),
}


@pytest.mark.parametrize("case", sorted(PROCESSOR_CASES))
def test_an_image_processor_that_cannot_feed_its_model_is_one_line(clip_copy, capsys, case):
    PROCESSOR_CASES[case](clip_copy / "processor_config.json")
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and out == "", (case, err)
    assert "processor" in err and str(clip_copy.name) in err, err


def test_an_image_processor_that_only_makes_other_numbers_is_the_models_own(clip_copy):
    """Another mean or no rescaling is a configuration a checkpoint may have: it loads (and scores other numbers)."""
    edit_json(clip_copy / "processor_config.json", lambda c: c["image_processor"].update(do_normalize=False))
    assert loading.load_processor(__import__("transformers").AutoProcessor, str(clip_copy)) is not None


@pytest.mark.parametrize("kind", ["dino", "llava", "llava_next", "siglip", "blip_itm", "vilt", "vit_gpt2_caption"])
def test_real_layouts_of_image_processors_pass_the_check(tiny_root, kind):
    """The probe and the tower's size are read as each family lays them out (DINO interpolates any size; LLaVA's
    CLIP tower takes one; LLaVA-NeXT tiles; BLIP, ViLT and ViT have their own towers)."""
    from transformers import AutoConfig, AutoImageProcessor

    from capeval_plugins.testing import tiny_checkpoint

    folder = tiny_checkpoint(kind, root=tiny_root)
    config = AutoConfig.from_pretrained(folder)
    assert agreement.image_processor_problem(AutoImageProcessor.from_pretrained(folder),
                                             agreement.vision_tower(config)) is None


# Settings no weight holds that make every output NaN: each gave exit 0 with every score null (n_invalid = n).
SETTINGS_CASES = {
    "a negative layer-norm epsilon": (("text_config", "layer_norm_eps"), -1.0),
    "a zero layer-norm epsilon": (("vision_config", "layer_norm_eps"), 0.0),
    "an infinite epsilon": (("text_config", "layer_norm_eps"), float("inf")),
}


@pytest.mark.parametrize("case", sorted(SETTINGS_CASES))
def test_a_setting_that_makes_every_output_nan_is_refused(clip_copy, capsys, case):
    (section, key), value = SETTINGS_CASES[case]
    edit_json(clip_copy / "config.json", lambda c: c[section].__setitem__(key, value))
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and out == "" and f"{section}.{key} = " in err, (case, err)


def test_real_settings_pass():
    """Epsilons and rotary bases of real checkpoints (BERT 1e-12, CLIP 1e-5, Llama 1e-6, Qwen2 rope 1e6)."""
    real = {"layer_norm_eps": 1e-12, "text_config": {"layer_norm_eps": 1e-5, "rms_norm_eps": 1e-6,
                                                      "rope_theta": 1_000_000.0, "layer_norm_epsilon": 1e-6}}
    assert wholeness.settings_problem(real) is None
    assert "rope_theta = 0" in wholeness.settings_problem({"text_config": {"rope_theta": 0}})


@pytest.mark.parametrize("eos", [5, 2])
def test_a_clip_config_that_pools_at_another_token_than_the_tokenizers_end_is_refused(clip_copy, capsys, eos):
    """CLIP reads a text's features at the configuration's eos_token_id (or, for 2, at the largest id): one of
    another checkpoint read every caption at another token, exit 0 (CLIPScore 0.577 instead of 0.254 on a
    tiny model)."""
    edit_json(clip_copy / "config.json", lambda c: c["text_config"].__setitem__("eos_token_id", eos))
    code, out, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and out == "" and f"eos_token_id is {eos}" in err, err


def test_the_real_clip_tokenizer_with_the_legacy_end_id_passes(tmp_path):
    """openai/clip-vit-base-patch32's config says eos_token_id 2 (the legacy reading: pool at the largest id),
    and its tokenizer's end token is its largest id."""
    from transformers import CLIPTextConfig

    from capeval_plugins.commands.convert_official import clip_tokenizer_from_bpe
    from capeval_plugins.testing.official import write_bpe

    tokenizer = clip_tokenizer_from_bpe(write_bpe(tmp_path / "bpe_simple_vocab_16e6.txt.gz"))  # OpenAI's layout
    config = CLIPTextConfig(eos_token_id=2, vocab_size=len(tokenizer))
    assert agreement.clip_pooling_problem(tokenizer, config) is None
    assert agreement.clip_pooling_problem(tokenizer, CLIPTextConfig(eos_token_id=tokenizer.eos_token_id)) is None
    assert "is id" in agreement.clip_pooling_problem(tokenizer, CLIPTextConfig(eos_token_id=tokenizer.eos_token_id - 1))


# A LLaVA processor and a config.json that disagree on the image tokens: each gave exit 1 and a traceback at the
# first batch (features and tokens do not match, or no image token found).
LVLM_CASES = {
    "another image token id": ("config.json", lambda c: c.update(image_token_index=5, image_token_id=5),
                               "image_token_id is 5"),
    "another feature strategy": ("config.json", lambda c: c.update(vision_feature_select_strategy="full"),
                                 "vision_feature_select_strategy"),
    "another patch size": ("processor_config.json", lambda c: c.update(patch_size=4), "patch_size is 4"),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", sorted(LVLM_CASES))
def test_a_vision_language_processor_of_another_checkpoint_is_one_line(tiny_root, tmp_path, capsys, case):
    from capeval_plugins.testing import tiny_checkpoint

    folder = tmp_path / "llava"
    shutil.copytree(tiny_checkpoint("llava", root=tiny_root), folder)
    name, change, words = LVLM_CASES[case]
    edit_json(folder / name, change)
    clear_cache()
    capsys.readouterr()  # the build's own progress bar, if this test built the checkpoint
    code, out, err = cli(["score", "-m", "fleur", "--model", folder, "--captions", EXAMPLES / "captions.jsonl",
                          "--images", EXAMPLES / "images", "--quiet"], capsys)
    assert code == 2 and one_line(err) and out == "" and words in err, (case, err)
    clear_cache()


@pytest.mark.parametrize("kind", ["clip", "siglip", "llava", "llava_next", "pacs", "polos", "dino", "blip_itm",
                                  "vilt", "vit_gpt2_caption", "blip_caption", "roberta", "bert"])
def test_every_family_s_processor_agrees_with_its_model(tiny_root, kind):
    """The other side: each family's own processor and model, as the builders save them, pass every check."""
    from transformers import AutoProcessor

    from capeval_plugins.testing import tiny_checkpoint

    folder = str(tiny_checkpoint(kind, root=tiny_root))
    clear_cache()
    try:
        loaded = AutoProcessor.from_pretrained(folder)
    except (OSError, ValueError):
        pytest.skip(f"{kind} has no processor transformers' AutoProcessor loads")  # pragma: no cover
    loading.check_against_model(loaded, folder, {})


def test_a_tokenizer_without_its_merges_would_score_otherwise():
    """Why the merges are checked: the same vocabulary without them splits every word into characters."""
    from capeval_plugins.testing.clip import clip_tokenizer

    tokenizer = clip_tokenizer()
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    assert wholeness.tokenizer_problem(data) is None
    data["model"]["merges"] = []
    assert "do not build" in wholeness.tokenizer_problem(data)


def safetensors_with(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = change(json.loads(blob[8 : 8 + n]))
    head = json.dumps(header).encode()  # ASCII: a lone surrogate stays a \\ud800 escape, as a crafted file has it
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + blob[8 + n :])


SAFETENSORS_CASES = {
    "a dimension of 2**64": lambda h: {**h, "extra": {"dtype": "F32", "shape": [2**64, 0], "data_offsets": [0, 0]}},
    "a product past 64 bits": lambda h: {**h, "extra": {"dtype": "F32", "shape": [2**40, 2**40, 0],
                                                        "data_offsets": [0, 0]}},
    "a lone-surrogate name": lambda h: {("text_projection.w\ud800" if k == "text_projection.weight" else k): v
                                        for k, v in h.items()},
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_crafted_safetensors_names_and_shapes_are_one_line(clip_copy, capsys, case):
    safetensors_with(clip_copy, SAFETENSORS_CASES[case])
    code, _, err = cli(clip_score(clip_copy), capsys)
    assert code == 2 and one_line(err) and "not a valid safetensors file" in err, (case, err)


@pytest.mark.parametrize("extra, words", [
    (["--device", "vulkan"], "vulkan"),
    (["-o", "device_map=bogus"], "device_map"),
    (["-o", 'device_map={"text_model": "nowhere"}'], "nowhere"),
])
def test_devices_this_torch_cannot_use_are_refused_before_loading(tiny_clip, capsys, monkeypatch, extra, words):
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    code, _, err = cli(clip_score(tiny_clip, *extra), capsys)
    assert code == 2 and one_line(err) and words in err, err


# ---------------------------------------------------------------------------------------------------------
# 6. Numeric options bounded by what their maths allows

@pytest.mark.parametrize("metric, option, value", [
    ("msd_score", "kappa", 1e308), ("msd_score", "gaussian_sigma", 1e-200), ("msd_score", "lam", 1e308),
    ("msd_score", "reinit_threshold", 2.0), ("mid", "covariance_eps", 1e308), ("redemption_score", "covariance_eps", 1e308),
    ("cider", "sigma", 1e200),
])
def test_options_past_their_maths_are_refused(metric, option, value):
    with pytest.raises(ValueError, match=option):
        capeval_plugins.load(metric, **{option: value})


def test_cider_sigma_1e200_is_one_line_on_the_command_line(capsys):
    code, _, err = cli(["score", "-m", "cider", "-o", "sigma=1e200", "-o", "tokenize=false", "--captions",
                        EXAMPLES / "captions.jsonl", "--quiet"], capsys)
    assert code == 2 and one_line(err) and "sigma" in err, err


# ---------------------------------------------------------------------------------------------------------
# The SD3 pipeline's parts are checked like every model

@pytest.mark.filterwarnings("ignore")
def test_a_stable_diffusion_part_missing_a_tensor_or_holding_nan_is_refused(tmp_path):
    pytest.importorskip("diffusers")
    from test_generation import build_tiny_sd3 as tiny_sd3_folder

    from capeval_plugins.models import generation

    whole = tiny_sd3_folder(tmp_path / "sd3")
    for part, damage in (("transformer", "missing"), ("vae", "nan"), ("text_encoder_3", "missing"),
                         ("transformer", "zeros"), ("text_encoder", "zeros"), ("tokenizer_3", "gone")):
        folder = tmp_path / f"{part}-{damage}"
        shutil.copytree(whole, folder)
        if damage == "gone":  # diffusers built a default tokenizer in its place and generated on
            shutil.rmtree(folder / part)
            clear_cache()
            sd3 = generation.StableDiffusion3(str(folder), steps=1, height=32, width=32, device="cpu")
            with pytest.raises(ModelLoadError, match=f"{part}/ is missing, though model_index.json names it"):
                sd3.pipeline  # noqa: B018
            continue
        name = "diffusion_pytorch_model.safetensors" if part in ("transformer", "vae") else "model.safetensors"
        stored = load_file(str(folder / part / name))
        if damage == "zeros":  # a download cut short into a pre-allocated file: the last matrix all zeros
            tensor = [k for k, v in sorted(stored.items()) if wholeness.zero_matrix(torch.zeros_like(v))][-1]
            change = lambda tensors, tensor=tensor: {**tensors, tensor: torch.zeros_like(tensors[tensor])}
        else:
            tensor = sorted(stored)[-1]
            change = without(tensor) if damage == "missing" else poisoned(tensor, float("nan"))
        rewrite(folder / part, change, name)
        clear_cache()
        sd3 = generation.StableDiffusion3(str(folder), steps=1, height=32, width=32, device="cpu")
        with pytest.raises(ModelLoadError, match=f"{part}/.*{'holds only zeros' if damage == 'zeros' else ''}"):
            sd3.pipeline  # noqa: B018
    clear_cache()
    assert generation.StableDiffusion3(str(whole), steps=1, height=32, width=32, device="cpu").pipeline is not None
    clear_cache()

