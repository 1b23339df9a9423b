"""MSD-Score's local vision-language aligner, the inference side (:mod:`.model`: settings, the aligner that gives
the ``msd_score`` / ``soft_msd`` metrics their patch and token embeddings, reading its checkpoint directory).
Training it is :mod:`capeval_plugins.training.msd_aligner`'s.

The names below are what the command line needs before anything heavy is imported.
"""

DEFAULT_VISION = "openai/clip-vit-large-patch14"
DEFAULT_LLM = "lmsys/vicuna-7b-v1.3"
TEXT_FEATURES = ("last_hidden", "input_embeddings")
TEXT_POOLINGS = ("content", "raw")
VISION_FEATURES = ("patch", "cls_patch")
