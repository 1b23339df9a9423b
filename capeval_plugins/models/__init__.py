"""Inference models, loaded whole through :mod:`capeval_plugins.resources.loading`: the encoders (CLIP, OpenAI's
CLIP, DINO, text encoders, ViLT / BLIP / ViLBERT), the LVLM judge and its batched decoder, Stable Diffusion 3
regeneration, Rigel's scorer and MSD-Score's local aligner. The metrics compose them; training
(:mod:`capeval_plugins.training`) stands above and writes the checkpoints :mod:`.rigel` and :mod:`.msd_aligner`
read.
"""
