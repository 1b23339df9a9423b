"""No supported combination of peft and torch loads a pickle: a Rigel checkpoint whose LoRA adapter is an
``adapter_model.bin`` is refused before anything is read (peft would ``torch.load`` it, and torch < 2.6, which
this package supports, unpickles by default)."""
from __future__ import annotations

import os
import pickle

import pytest

from capeval_plugins.resources.loading import ModelLoadError
from capeval_plugins.models.rigel import ADAPTER_DIR, load_rigel


class Payload:
    """Unpickling it writes a file: proof that a pickle was loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_adapter_is_refused_before_it_is_read(tmp_path):
    marker = tmp_path / "unpickled"
    adapter = tmp_path / "rigel" / ADAPTER_DIR
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(ModelLoadError, match=r"no adapter_model\.safetensors \(found adapter_model\.bin: pickled "
                                             r"weights are never loaded\)"):
        load_rigel(tmp_path / "rigel")
    assert not marker.exists()
    assert os.path.isfile(adapter / "adapter_model.bin")  # refused, not touched
