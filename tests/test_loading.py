"""Model loading in one place: safetensors only, offline flags honoured, device/dtype once, shared."""
from __future__ import annotations

import shutil

import pytest
import torch

from capeval_plugins.core import loading


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
