"""Encoders shared by metrics: one module per family, pure tensor code over transformers models.

- ``clip``: CLIP-family dual encoders (global embeddings; patch and token embeddings in the joint space)
- ``common``: spec of a checkpoint to load, pooled-output handling, segment reductions
Further families (DINO, text encoders, image-conditioned text encoders, the ViLBERT model in ``vilbert``) live
beside them.
"""
from capeval_plugins.models.encoders.clip import ClipEncoder, LocalFeatures
from capeval_plugins.models.encoders.common import EncoderSpec, mean_pooled, pooled, segment_max

__all__ = ["ClipEncoder", "EncoderSpec", "LocalFeatures", "mean_pooled", "pooled", "segment_max"]
