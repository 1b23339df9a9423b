"""Model loading in one place: safetensors only, offline flags honoured, device/dtype once, shared."""
from __future__ import annotations

import shutil

import pytest
import torch

from capeval_plugins.resources import loading


def test_device_and_dtype_resolution():
    cpu = torch.device("cpu")
    assert loading.resolve_device("cpu") == cpu
    assert loading.resolve_dtype(None, cpu, torch.bfloat16) == torch.float32  # CPU default
    assert loading.resolve_dtype(None, torch.device("cuda"), torch.bfloat16) == torch.bfloat16
    assert loading.resolve_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        loading.resolve_dtype("float8", cpu)


def test_shared_per_checkpoint_device_and_dtype(tiny_clip):
    from transformers import AutoModel

    a = loading.load_model(AutoModel, tiny_clip, device="cpu")
    b = loading.load_model(AutoModel, tiny_clip + "/", device="cpu")  # same folder, other spelling
    c = loading.load_model(AutoModel, tiny_clip, device="cpu", dtype="bfloat16")
    assert a is b and a is not c
    assert next(c.parameters()).dtype == torch.bfloat16 and not a.training
    assert not any(p.requires_grad for p in a.parameters())


def test_safetensors_only(tiny_clip, tmp_path):
    """A checkpoint that ships only pickle weights is refused (pickles can run code on load)."""
    from transformers import AutoModel, CLIPModel

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_clip, pickled)
    model = CLIPModel.from_pretrained(tiny_clip)
    (pickled / "model.safetensors").unlink()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(OSError):
        loading.load_model(AutoModel, str(pickled))


def test_local_files_only_never_reaches_the_network(monkeypatch):
    import socket

    from transformers import AutoModel

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    with pytest.raises(OSError):
        loading.load_model(AutoModel, "openai/clip-vit-base-patch32-not-cached", local_files_only=True)


def test_trust_remote_code_is_off_unless_asked():
    assert loading.hub_kwargs(None, None, False) == {"trust_remote_code": False}
    assert loading.hub_kwargs("main", True, True) == {"trust_remote_code": True, "revision": "main",
                                                      "local_files_only": True}
    with pytest.raises(ValueError, match="no model"):
        loading.load_model(object, "")


def test_share_false_gives_a_private_copy(tiny_clip):
    from transformers import AutoModel

    shared = loading.load_model(AutoModel, tiny_clip, device="cpu")
    private = loading.load_model(AutoModel, tiny_clip, device="cpu", share=False)
    assert private is not shared
    assert all(torch.equal(a, b) for a, b in zip(shared.state_dict().values(), private.state_dict().values()))
    assert loading.load_model(AutoModel, tiny_clip, device="cpu") is shared


# --- placement: device_map, max_memory, offload_folder -------------------------------------------------------


def test_placement_specs_are_hashable_and_one_per_placement(tmp_path):
    a = loading.ModelSpec("m", device_map={"lm_head": "disk", "model": 0}, max_memory={"0": "70GiB", "cpu": 10**9},
                          offload_folder=tmp_path)
    b = loading.ModelSpec("m", device_map={"model": "0", "lm_head": "disk"}, max_memory={"cpu": 10**9, 0: "70GiB"},
                          offload_folder=str(tmp_path) + "/")
    assert a == b and hash(a) == hash(b)
    assert a.placement() == {"device_map": (("lm_head", "disk"), ("model", 0)),
                             "max_memory": ((0, "70GiB"), ("cpu", 10**9)), "offload_folder": str(tmp_path)}
    assert loading.ModelSpec("m", device_map="auto").device_map == "auto"
    with pytest.raises(ValueError, match="max_memory"):
        loading.ModelSpec("m", device_map="auto", max_memory={"cpu": 1.5})
    with pytest.raises(ValueError, match="device_map"):
        loading.ModelSpec("m", device_map=["auto"])


def test_placement_options_parse_on_the_command_line():
    from capeval_plugins import options as metric_options_module
    from capeval_plugins import registry

    def metric_options(cls, pairs):
        bare, own = metric_options_module.parse_pairs(pairs, ["discode"])
        return metric_options_module.route({"discode": cls}, bare, own, parse=True)["discode"]

    cls = registry.get("discode").cls
    options = metric_options(cls, ["device_map=auto", 'max_memory={"0": "70GiB", "cpu": "200GiB"}',
                                   "offload_folder=/tmp/offload"])
    assert options == {"device_map": "auto", "max_memory": {"0": "70GiB", "cpu": "200GiB"},
                       "offload_folder": "/tmp/offload"}
    spec = loading.ModelSpec.from_config(cls.Config(**options))
    assert spec.device_map == "auto" and dict(spec.max_memory) == {0: "70GiB", "cpu": "200GiB"}
    assert metric_options(cls, ['device_map={"model": 0, "lm_head": "cpu"}'])["device_map"] == {"model": 0,
                                                                                                  "lm_head": "cpu"}


def test_placement_errors_are_clear(monkeypatch, tiny_clip):
    from transformers import AutoModel

    with pytest.raises(ValueError, match="only apply with a device_map"):
        loading.load_model(AutoModel, tiny_clip, max_memory={"cpu": "1GiB"})
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name, *a: None if name == "accelerate"
                        else real(name, *a))
    with pytest.raises(ImportError, match=r"needs accelerate.*-e '\.\[accelerate\]"):
        loading.load_model(AutoModel, tiny_clip, device_map="auto", share=False)
