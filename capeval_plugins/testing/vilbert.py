"""Tiny ViLBERT checkpoints in the released format, converted as a user would, and fake region features.

``build_tiny("vilbert", DIR)`` writes ``DIR/released/multi_task_model.bin`` (a PyTorch pickle of tensors under the
released parameter names, with the 12-in-1 task heads, the pretraining heads, the poolers and the unused
``q_dense`` projections, the decoder tied to the word embeddings as in the real file), the released-style
configuration JSON and a WordPiece tokenizer beside it, then runs the conversion into ``DIR``, so ``model=DIR``
loads. ``vilbert_pretrained`` is the same without task tokens and with the pretraining heads only
(``pretrained_model.bin``). The streams differ in width (text 32, regions 48, co-attention 40), so a swapped
projection cannot go unnoticed, and every LayerNorm and bias is random, not 1 and 0.

:func:`write_region_features` writes fake per-image feature files in the extraction script's layout.
"""
from __future__ import annotations

import io
import json
import zlib
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from capeval_plugins.testing import builder

# The released bert_base_6layer_6conect.json, scaled down (same keys, including those inference never reads).
TINY_RELEASED_CONFIG = {
    "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 64, "num_attention_heads": 4,
    "num_hidden_layers": 4, "type_vocab_size": 2, "v_feature_size": 2048, "v_target_size": 1601,
    "v_hidden_size": 48, "v_num_hidden_layers": 2, "v_num_attention_heads": 4, "v_intermediate_size": 56,
    "bi_hidden_size": 40, "bi_num_attention_heads": 4, "bi_intermediate_size": 40, "bi_attention_type": 1,
    "v_attention_probs_dropout_prob": 0.1, "v_hidden_act": "gelu", "v_hidden_dropout_prob": 0.1,
    "v_initializer_range": 0.02, "v_biattention_id": [0, 1], "t_biattention_id": [2, 3], "pooling_method": "mul",
}
TASK_TOKENS = 20  # nn.Embedding(20, hidden) in the released code
VQA_ANSWERS, GQA_ANSWERS, VISUAL_GENOME_CLASSES = 3129, 1533, 1601


def tiny_vilbert(seed: int, vocab_size: int, task_tokens: bool = True, config: Mapping[str, Any] | None = None):
    """A random :class:`ViLBertModel` and its released-style state dict (``bert.*`` plus heads)."""
    import torch

    from capeval_plugins.models.encoders.vilbert import ViLBertModel, config_from_released_json

    model_config, _ = config_from_released_json({**TINY_RELEASED_CONFIG, **(config or {}), "vocab_size": vocab_size})
    model_config.num_task_tokens = TASK_TOKENS if task_tokens else 0
    torch.manual_seed(seed)
    model = ViLBertModel(model_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "LayerNorm" in name:
                param.add_(0.1 * torch.randn_like(param))
    released = {f"bert.{k}": v for k, v in model.state_dict().items()}
    released.update(_released_heads(model.config, released, task_tokens))
    return model, released


def _released_heads(config, backbone: dict, multi_task: bool) -> dict:
    """Parameters the released files hold beside the backbone, with their real shapes (random values)."""
    import torch

    h, v, bi = config.hidden_size, config.v_hidden_size, config.bi_hidden_size

    def linear(prefix: str, n_out: int, n_in: int) -> dict:
        return {f"{prefix}.weight": 0.02 * torch.randn(n_out, n_in), f"{prefix}.bias": torch.zeros(n_out)}

    def norm(prefix: str, n: int) -> dict:
        return {f"{prefix}.weight": torch.ones(n), f"{prefix}.bias": torch.zeros(n)}

    heads = {**linear("bert.t_pooler.dense", bi, h), **linear("bert.v_pooler.dense", bi, v)}
    for k in range(config.num_coattention_layers):
        heads.update(linear(f"bert.encoder.c_layer.{k}.biOutput.q_dense1", v, bi))
        heads.update(linear(f"bert.encoder.c_layer.{k}.biOutput.q_dense2", h, bi))
    heads.update({"cls.predictions.bias": torch.zeros(config.vocab_size),
                  # tied to the word embeddings, so the file stores one storage under two names
                  "cls.predictions.decoder.weight": backbone["bert.embeddings.word_embeddings.weight"]})
    heads.update(linear("cls.predictions.transform.dense", h, h))
    heads.update(norm("cls.predictions.transform.LayerNorm", h))
    heads.update(linear("cls.bi_seq_relationship", 2, bi))
    heads.update(linear("cls.imagePredictions.transform.dense", v, v))
    heads.update(norm("cls.imagePredictions.transform.LayerNorm", v))
    heads.update(linear("cls.imagePredictions.decoder", VISUAL_GENOME_CLASSES, v))
    if multi_task:
        for name, n_in, n_out in (("vil_prediction", bi, VQA_ANSWERS), ("vil_prediction_gqa", bi, GQA_ANSWERS),
                                  ("vil_binary_prediction", 2 * bi, 2)):
            heads.update(linear(f"{name}.logit_fc.0", 2 * bi, n_in))
            heads.update(norm(f"{name}.logit_fc.2", 2 * bi))
            heads.update(linear(f"{name}.logit_fc.3", n_out, 2 * bi))
        heads.update({**linear("vil_logit", 1, bi), **linear("vil_tri_prediction", 3, bi),
                      **linear("vision_logit", 1, v), **linear("linguisic_logit", 1, h)})
    return heads


def _build(path: Path, seed: int, task_tokens: bool, file_name: str) -> None:
    import torch

    from capeval_plugins.commands.convert import convert_vilbert
    from capeval_plugins.testing.text_encoders import bert_tokenizer

    released_dir = path / "released"
    released_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = bert_tokenizer()
    tokenizer.save_pretrained(released_dir / "tokenizer")
    _, released = tiny_vilbert(seed, len(tokenizer), task_tokens)
    torch.save(released, released_dir / file_name)
    config_file = released_dir / "bert_tiny_config.json"
    config_file.write_text(json.dumps({**TINY_RELEASED_CONFIG, "vocab_size": len(tokenizer)}, indent=2))
    convert_vilbert(released_dir / file_name, path, config_file, tokenizer=str(released_dir / "tokenizer"),
                    overwrite=True)


@builder("vilbert")
def build_vilbert(path: Path, seed: int) -> None:
    _build(path, seed, task_tokens=True, file_name="multi_task_model.bin")


@builder("vilbert_pretrained")
def build_vilbert_pretrained(path: Path, seed: int) -> None:
    _build(path, seed, task_tokens=False, file_name="pretrained_model.bin")


# --- fake region features -----------------------------------------------------------------------------------------
def fake_region_dict(rng: np.random.Generator, n_boxes: int, feature_dim: int = 2048, image_id: str = "") -> dict:
    """A random dict in the extraction script's layout (``np.save`` of it is what the script writes)."""
    width, height = int(rng.integers(64, 640)), int(rng.integers(64, 640))
    x1, y1 = rng.uniform(0, 0.8 * width, n_boxes), rng.uniform(0, 0.8 * height, n_boxes)
    x2, y2 = x1 + rng.uniform(1, 0.2 * width, n_boxes), y1 + rng.uniform(1, 0.2 * height, n_boxes)
    scores = rng.dirichlet(np.ones(VISUAL_GENOME_CLASSES), n_boxes).astype(np.float32)
    return {
        "bbox": np.stack([x1, y1, x2, y2], axis=1).astype(np.float32),
        "num_boxes": n_boxes,
        "objects": scores[:, 1:].argmax(axis=1),
        "image_width": width,
        "image_height": height,
        "cls_prob": scores,
        "image_id": image_id,
        "features": np.abs(rng.standard_normal((n_boxes, feature_dim))).astype(np.float32),  # fc6 follows a ReLU
    }


def save_region_dict(path: str | Path, data: Mapping[str, Any]) -> Path:
    """``data`` as ``.npy`` (``np.save`` of the dict, as the extraction script) or ``.npz`` (by suffix)."""
    from capeval_plugins import files

    path = Path(path)
    buffer = io.BytesIO()
    if path.suffix == ".npz":
        np.savez(buffer, **{k: np.asarray(v) for k, v in data.items()})
    else:
        np.save(buffer, dict(data), allow_pickle=True)
    files.write_output(path, buffer.getvalue(), what="region features")
    return path


def write_region_features(folder: str | Path, names: Iterable[str], boxes: int | tuple[int, int] = (3, 9),
                          suffix: str = ".npy", seed: int = 0, feature_dim: int = 2048) -> list[Path]:
    """One fake feature file per image name (``<name up to the first dot><suffix>``), with a number of boxes
    drawn from ``boxes`` (a count, or an inclusive range). Each image's values depend only on its name and
    ``seed``."""
    from capeval_plugins import files

    folder = Path(folder)
    files.Folder.open(folder, create=True)[0].close()
    out = []
    for name in names:
        stem = Path(str(name)).name.split(".")[0]
        rng = np.random.default_rng([seed, zlib.crc32(stem.encode())])
        n = boxes if isinstance(boxes, int) else int(rng.integers(boxes[0], boxes[1] + 1))
        out.append(save_region_dict(folder / f"{stem}{suffix}", fake_region_dict(rng, n, feature_dim, stem)))
    return out
