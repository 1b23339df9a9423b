"""Issue 49, item 4: the one-line rule holds by construction. Hypothesis damages real tiny model folders and
released checkpoints (a truncated file, a flipped header byte, a dropped tensor or key, a tensor of another shape
or with a non-finite value, a changed size in config.json, a planted tensor, a damaged hparams.yaml) and each run
either gives exactly the whole model's numbers or is refused in one line with exit code 2: never a traceback,
never other numbers.

The mutations are those whose result is decidable from the files: each either leaves the model exactly as it was
or makes it disagree with itself. Edits that make another whole model (a different activation name, a different
number of attention heads, another word in the vocabulary) are outside: nothing can tell them from a real
checkpoint. Every case runs in this process (the command line's ``main``), deadline off, the too-slow health check
off: these tests are about outcomes, not speed."""
from __future__ import annotations

import io
import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import capeval_in_process
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from capeval_plugins.resources.loading import clear_cache
from capeval_plugins.testing import official, scratch_folder

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# not about speed; derandomized: the same cases on every machine and run
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
                derandomize=True, database=None)


def score(model: Path):
    return capeval_in_process(["score", "-m", "clipscore", "-m", "refclipscore", "--model", model, "--captions",
                               EXAMPLES / "captions.jsonl", "--images", EXAMPLES / "images", "--quiet"])


def whole_or_refused(proc, whole: dict) -> None:
    """The property: the whole model's numbers, or one line and exit code 2."""
    event("scored as whole" if proc.returncode == 0 else "refused")
    if proc.returncode == 0:
        assert json.loads(proc.stdout)["metrics"] == whole, proc.stdout
    else:
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("capeval: error: "), proc.stderr[-3000:]
        assert proc.stdout == ""


@pytest.fixture(scope="module")
def whole_clip(tiny_clip):
    clear_cache()
    proc = score(Path(tiny_clip))
    assert proc.returncode == 0, proc.stderr
    return Path(tiny_clip), json.loads(proc.stdout)["metrics"]


# --- the model folder ------------------------------------------------------------------------------------------

FILES = ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json"]
# config.json sizes that set tensor shapes (a changed number of heads would be another whole model)
SIZES = [("text_config", "vocab_size"), ("text_config", "hidden_size"), ("text_config", "intermediate_size"),
         ("text_config", "num_hidden_layers"), ("text_config", "max_position_embeddings"),
         ("vision_config", "hidden_size"), ("vision_config", "intermediate_size"),
         ("vision_config", "num_hidden_layers"), ("vision_config", "patch_size"), ("vision_config", "num_channels"),
         (None, "projection_dim")]
REQUIRED_KEYS = [("config.json", ("model_type",)), ("config.json", ("text_config",)),
                 ("config.json", ("vision_config",)), ("tokenizer.json", ("model",)),
                 ("tokenizer.json", ("added_tokens",)), ("tokenizer.json", ("model", "merges")),
                 ("tokenizer.json", ("model", "vocab"))]

MUTATION = st.one_of(
    st.tuples(st.just("truncate"), st.sampled_from(FILES), st.floats(0, 1)),
    st.tuples(st.just("flip a header byte"), st.integers(0, 10**9), st.integers(1, 255)),
    st.tuples(st.just("drop a tensor"), st.integers(0, 10**9)),
    st.tuples(st.just("reshape a tensor"), st.integers(0, 10**9), st.sampled_from([-1, 1])),
    st.tuples(st.just("a non-finite value"), st.integers(0, 10**9), st.sampled_from([math.nan, math.inf, -math.inf])),
    st.tuples(st.just("change a size"), st.sampled_from(SIZES), st.sampled_from([0, 1, -1, 2, 10**9])),
    st.tuples(st.just("drop a key"), st.sampled_from(REQUIRED_KEYS)),
    st.tuples(st.just("plant a tensor"), st.sampled_from(["lm_head.weight", "text_model.extra.weight",
                                                          "vision_model.encoder.layers.9.mlp.fc1.weight"])),
)


def mutate(folder: Path, mutation: tuple) -> None:
    kind, *args = mutation
    event(kind)
    weights = folder / "model.safetensors"
    if kind == "truncate":
        path = folder / args[0]
        data = path.read_bytes()
        path.write_bytes(data[: int(args[1] * len(data))])
    elif kind == "flip a header byte":
        data = bytearray(weights.read_bytes())
        n = int.from_bytes(data[:8], "little")
        position = 8 + args[0] % n
        data[position] ^= args[1]
        weights.write_bytes(bytes(data))
    elif kind == "change a size":
        (section, key), change = args
        config = json.loads((folder / "config.json").read_text())
        where = config[section] if section else config
        where[key] = change if change in (0, 1, 10**9) else where[key] + change * (2 if change == 2 else 1)
        (folder / "config.json").write_text(json.dumps(config))
    elif kind == "drop a key":
        name, path = args[0]
        data = json.loads((folder / name).read_text())
        inner = data
        for key in path[:-1]:
            inner = inner[key]
        inner.pop(path[-1])
        (folder / name).write_text(json.dumps(data))
    else:
        tensors = load_file(str(weights))
        names = sorted(tensors)
        if kind == "drop a tensor":
            tensors.pop(names[args[0] % len(names)])
        elif kind == "reshape a tensor":
            name = names[args[0] % len(names)]
            t = tensors[name]
            if t.dim() == 0 or (t.shape[0] == 1 and args[1] < 0):
                tensors[name] = torch.zeros(2, *t.shape)
            else:
                tensors[name] = torch.zeros(t.shape[0] + args[1], *t.shape[1:], dtype=t.dtype)
        elif kind == "a non-finite value":
            name = names[args[0] % len(names)]
            tensors[name] = tensors[name].clone()
            tensors[name].view(-1)[0] = args[1]
        elif kind == "plant a tensor":
            tensors[args[0]] = torch.zeros(4, 4)
        save_file(tensors, str(weights), metadata={"format": "pt"})


@settings(SLOW, max_examples=100)
@given(MUTATION)
def test_a_damaged_model_folder_scores_as_the_whole_one_or_is_refused_in_one_line(whole_clip, mutation):
    source, whole = whole_clip
    folder = scratch_folder("capeval-mutated-clip-")
    try:
        shutil.copytree(source, folder / "clip")
        mutate(folder / "clip", mutation)
        clear_cache()
        whole_or_refused(score(folder / "clip"), whole)
    finally:
        clear_cache()
        shutil.rmtree(folder, ignore_errors=True)


# --- released checkpoints: capeval convert pacs / polos -----------------------------------------------------------

@pytest.fixture(scope="module")
def released_pacs(tmp_path_factory):
    from capeval_plugins.commands.convert_official import convert_pacs

    root = tmp_path_factory.mktemp("released-pacs")
    bpe = official.write_bpe(root / "bpe.txt.gz")
    source = official.released_pacs(root / "clip_ViT-B-32.pth", bpe=bpe)
    convert_pacs(source, root / "whole", "vit-b-32", str(bpe))
    return source, bpe, load_file(str(root / "whole" / "model.safetensors"))


STATE_MUTATION = st.one_of(
    st.tuples(st.just("drop"), st.integers(0, 10**9)),
    st.tuples(st.just("reshape"), st.integers(0, 10**9), st.sampled_from([-1, 1])),
    st.tuples(st.just("non-finite"), st.integers(0, 10**9), st.sampled_from([math.nan, math.inf])),
    st.tuples(st.just("float8"), st.integers(0, 10**9)),
    st.tuples(st.just("zero width"), st.integers(0, 10**9)),
    st.tuples(st.just("unknown"), st.sampled_from(["visual.extra", "transformer.resblocks.0.extra", "scalar"])),
)


def mutate_state(state: dict, mutation: tuple) -> dict:
    kind, *args = mutation
    event(f"state: {kind}")
    names = sorted(k for k, v in state.items() if v.is_floating_point())
    name = names[args[0] % len(names)] if isinstance(args[0], int) else None
    state = dict(state)
    if kind == "drop":
        state.pop(name)
    elif kind == "reshape":
        t = state[name]
        state[name] = torch.zeros(max(t.shape[0] + args[1], 1) if t.dim() else 2, *t.shape[1:])
    elif kind == "non-finite":
        state[name] = state[name].clone()
        state[name].view(-1)[0] = args[1]
    elif kind == "float8":
        state[name] = state[name].to(torch.float8_e4m3fn)
    elif kind == "zero width":
        state[name] = torch.zeros(*state[name].shape[:-1], 0) if state[name].dim() > 1 else torch.zeros(0, 2)
    elif kind == "unknown":
        state[args[0]] = torch.ones(2)
    return state


def save_pth(state: dict, path: Path, **extra) -> Path:
    buffer = io.BytesIO()
    torch.save({"state_dict": state, **extra}, buffer)
    path.write_bytes(buffer.getvalue())
    return path


@settings(SLOW, max_examples=50)
@given(STATE_MUTATION)
def test_a_damaged_released_pacs_checkpoint_converts_to_the_same_weights_or_is_refused(released_pacs, mutation):
    source, bpe, whole = released_pacs
    folder = scratch_folder("capeval-mutated-pacs-")
    try:
        state = torch.load(source, weights_only=True)["state_dict"]
        damaged = save_pth(mutate_state(state, mutation), folder / "x.pth")
        proc = capeval_in_process(["convert", "pacs", damaged, folder / "out", "--backbone", "vit-b-32",
                                   "--tokenizer", bpe])
        if proc.returncode == 0:
            converted = load_file(str(folder / "out" / "model.safetensors"))
            assert converted.keys() == whole.keys() and all(torch.equal(converted[k], whole[k]) for k in whole)
        else:
            whole_or_refused(proc, {})
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def released_polos(tmp_path_factory, tiny_root):
    from capeval_plugins.commands.convert_official import convert_polos
    from capeval_plugins.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("released-polos")
    roberta = tiny_checkpoint("simcse_roberta", root=tiny_root)
    bpe = official.write_bpe(root / "bpe.txt.gz")
    source = official.released_polos(root / "reprod", roberta, bpe)
    convert_polos(source, root / "whole", text_tokenizer=str(roberta), clip_tokenizer=str(bpe))
    return source, roberta, bpe, load_file(str(root / "whole" / "model.safetensors"))


POLOS_MUTATION = st.one_of(
    st.tuples(st.just("hparams: flip"), st.integers(0, 10**9), st.integers(1, 255)),
    st.tuples(st.just("hparams: truncate"), st.floats(0, 1)),
    st.tuples(st.just("state"), STATE_MUTATION),
    st.tuples(st.just("head"), st.sampled_from(["ff.0.ff.linear_2.weight", "scalar_mix.scalar_parameters.1",
                                                "scalar_mix.gamma"]), st.sampled_from(["drop", "widen"])),
)


@settings(SLOW, max_examples=50)
@given(POLOS_MUTATION)
def test_a_damaged_polos_release_converts_to_the_same_weights_or_is_refused(released_polos, mutation):
    source, roberta, bpe, whole = released_polos
    folder = scratch_folder("capeval-mutated-polos-")
    try:
        shutil.copytree(source.parent, folder / "reprod")
        kind, *args = mutation
        event(kind)
        hparams = folder / "reprod" / "hparams.yaml"
        if kind == "hparams: flip":
            data = bytearray(hparams.read_bytes())
            data[args[0] % len(data)] ^= args[1]
            hparams.write_bytes(bytes(data))
        elif kind == "hparams: truncate":
            hparams.write_bytes(hparams.read_bytes()[: int(args[0] * len(hparams.read_bytes()))])
        else:
            checkpoint = torch.load(source, weights_only=False)
            state = checkpoint["state_dict"]
            if kind == "state":
                state = mutate_state(state, args[0])
            elif args[1] == "drop":
                state.pop(args[0])
            else:
                state[args[0]] = torch.zeros(*state[args[0]].shape[:-1], state[args[0]].shape[-1] + 1)
            save_pth(state, folder / "reprod" / "reprod.ckpt", hyper_parameters=checkpoint["hyper_parameters"])
        proc = capeval_in_process(["convert", "polos", folder / "reprod" / "reprod.ckpt", folder / "out",
                                   "--text-tokenizer", roberta, "--clip-tokenizer", bpe])
        if proc.returncode == 0:
            converted = load_file(str(folder / "out" / "model.safetensors"))
            assert converted.keys() == whole.keys() and all(torch.equal(converted[k], whole[k]) for k in whole)
        else:
            whole_or_refused(proc, {})
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_flipping_the_dtype_of_a_weight_to_an_integer_is_refused(whole_clip):
    """A one-byte flip the size checks cannot see: F32 -> I32 keeps every byte count."""
    source, whole = whole_clip
    folder = scratch_folder("capeval-dtype-flip-")
    try:
        shutil.copytree(source, folder / "clip")
        path = folder / "clip" / "model.safetensors"
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = data[8 : 8 + n].replace(b'"F32"', b'"I32"', 1)
        path.write_bytes(struct.pack("<Q", n) + header + data[8 + n :])
        clear_cache()
        proc = score(folder / "clip")
        assert proc.returncode == 2 and "I32" in proc.stderr, proc.stderr
    finally:
        clear_cache()
        shutil.rmtree(folder, ignore_errors=True)
