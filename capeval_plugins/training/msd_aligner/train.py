"""Training MSD-Score's local aligner (paper Sec. 3.2, Eqs. 4-5): the CLIP vision tower and the LLM frozen, one
linear projector (and, CLIP-style, the contrastive temperature) trained on image-caption pairs.

Per batch of B pairs::

    L = w_con L_con + w_rec L_rec
    L_con = (CE(s I T^T, diag) + CE(s T I^T, diag)) / 2     (Eq. 4: symmetric, in-batch negatives, s = 1/tau)
    L_rec = mean over the batch's caption tokens of -log p(token | BOS, projected patches, earlier tokens)  (Eq. 5)

I and T are the pooled image and caption embeddings (normalised means of the normalised patch and token
embeddings, :mod:`.model`); the reconstruction feeds the projected patches to the frozen LLM as a visual prefix
followed by the caption, LLaVA's "plain" pre-training template (BOS, patches, caption + "\\n"; the loss on the
caption tokens only).

The paper gives no weights, temperature or optimisation settings; the defaults are LLaVA v1's CC3M-595K projector
stage (AdamW, lr 2e-3, batch 128, one epoch, cosine schedule with 3% warm-up, no weight decay, the CLIP
penultimate layer) and CLIP's learned temperature (logit scale initialised at 1/0.07, capped at 100), each a
field of :class:`AlignerConfig` or :class:`~.model.AlignerSettings`.

The frozen vision tower's patch features can be cached on disk once (``cache_dir``; shards keyed by the backbone
and the data, about 0.5 MiB per image for ViT-L/14 in 16 bits). The state (projector, temperature, optimiser,
position in the epoch) is saved every ``save_every`` steps and after every epoch; calling again with the same
arguments continues an interrupted run and ends where an uninterrupted one would.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.digests import model_files_digest
from capeval_plugins.resources import loading
from capeval_plugins.core.bounds import bounded, check_fields
from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec, mean_pooled
from capeval_plugins.inputs import iter_batches, to_batch
from capeval_plugins.training.checkpoint import json_bytes, output_folder, tensor_bytes
from capeval_plugins.training.features import ShardedRows, cached_shards
from capeval_plugins.training.msd_aligner import SCHEDULES
from capeval_plugins.training.msd_aligner.data import CaptionSet
from capeval_plugins.models.msd_aligner.model import (CONFIG_FILE, FORMAT, FORMAT_VERSION, PROJECTOR_FILE,
                                                      TOKENIZER_DIR, TOKENS_FILE, AlignerSettings, LocalAligner,
                                                      build_projector, load_llm, load_llm_tokenizer,
                                                      vision_fingerprint, vision_tower)
from capeval_plugins.training.state import run_steps, signature, start_or_resume, step_record

# Fields that change how a run is carried out, not what it computes: a resumed run may change them.
OPERATIONAL = ("save_every", "extract_batch_size", "shard_size")


@dataclass
class AlignerConfig:
    """Optimisation settings. The paper gives none; defaults are LLaVA v1's CC3M-595K projector stage and CLIP's
    temperature."""

    epochs: int = bounded(1, ge=1)
    batch_size: int = bounded(128, ge=1)
    micro_batch_size: int = bounded(16, ge=1)
    lr: float = bounded(2e-3, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = bounded(1e-8, gt=0)
    warmup_ratio: float = bounded(0.03, ge=0, lt=1)
    schedule: str = "cosine"
    contrastive_weight: float = bounded(1.0, ge=0)
    reconstruction_weight: float = bounded(1.0, ge=0)
    temperature: float = bounded(0.07, gt=0)
    learn_temperature: bool = True
    max_logit_scale: float = bounded(100.0, gt=0)
    gradient_checkpointing: bool = False
    seed: int = bounded(0, ge=0)
    save_every: int = bounded(200, ge=1)
    extract_batch_size: int = bounded(64, ge=1)
    shard_size: int = bounded(1024, ge=1)

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        check_fields(self, "aligner training")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.contrastive_weight + self.reconstruction_weight == 0:
            raise ValueError("aligner training: the loss weights must not both be zero")
        if not 1 / self.temperature <= self.max_logit_scale:
            raise ValueError("aligner training: 1 / temperature must be <= max_logit_scale")


# --- the two objectives ------------------------------------------------------------------------------------------


def contrastive_loss(image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
    """Eq. 4: symmetric InfoNCE over the B x B cosines of normalised global embeddings, pair i matching i."""
    logits = scale * image @ text.T
    target = torch.arange(len(image), device=image.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def caption_ids(tokenizer: Any, captions: Sequence[str], suffix: str, room: int) -> list[list[int]]:
    """The caption tokens of LLaVA's plain template (caption + suffix, no BOS), at most ``room`` each."""
    if room < 1:
        raise ValueError(f"no room for caption tokens: the visual prefix fills the {room + 1}-token context")
    encoded = tokenizer([c + suffix for c in captions], add_special_tokens=False)["input_ids"]
    return [ids[:room] for ids in encoded]


def reconstruction_nll(llm: Any, bos_id: int | None, prefix: Tensor, ids: Sequence[Sequence[int]],
                       pad_id: int = 0) -> tuple[Tensor, int]:
    """Eq. 5 for a few pairs: the summed negative log-likelihood of the caption tokens ``ids`` given BOS and the
    projected patches ``prefix`` (m, N, d) as the frozen LLM's input, and the number of tokens. The sequences are
    right-padded; only the logits at the positions that predict caption tokens are computed."""
    m, n_patches, _ = prefix.shape
    width = max(len(x) for x in ids)
    device = prefix.device
    tokens = torch.full((m, width), pad_id, dtype=torch.long)
    present = torch.zeros((m, width), dtype=torch.bool)
    for row, x in enumerate(ids):
        tokens[row, :len(x)] = torch.tensor(x, dtype=torch.long)
        present[row, :len(x)] = True
    tokens, present = tokens.to(device), present.to(device)
    embed = llm.get_input_embeddings()
    dtype = embed.weight.dtype
    parts = [prefix.to(dtype), embed(tokens)]
    if bos_id is not None:
        parts.insert(0, embed(torch.full((m, 1), bos_id, dtype=torch.long, device=device)))
    inputs = torch.cat(parts, dim=1)
    head = inputs.shape[1] - width  # BOS and the patches
    attention = torch.cat([torch.ones((m, head), dtype=torch.long, device=device), present.long()], dim=1)
    # The last width + 1 positions: the final patch predicts the first caption token, ..., the last one nothing.
    logits = llm(inputs_embeds=inputs, attention_mask=attention, logits_to_keep=width + 1).logits[:, :-1]
    targets = tokens.masked_fill(~present, -100)
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                          reduction="sum")
    return nll, int(present.sum())


def lr_factor(step: int, total: int, warmup_ratio: float, schedule: str = "cosine") -> float:
    """The learning-rate multiplier at ``step`` (0-based) of ``total``: linear warm-up over
    ceil(warmup_ratio * total) steps, then constant or half a cosine down to 0 (as transformers' schedules)."""
    warmup = math.ceil(total * warmup_ratio)
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


# --- the frozen vision features ------------------------------------------------------------------------------------


class PatchFeatures:
    """The frozen vision tower's features of any rows of a caption set: read from a shard cache on disk
    (extracted once, ``cache_dir``), or computed for each batch."""

    def __init__(self, aligner: LocalAligner, data: CaptionSet, config: AlignerConfig,
                 cache_dir: str | os.PathLike | None = None, progress: bool = True):
        self.aligner, self.data, self.config = aligner, data, config
        self.cached: ShardedRows | None = None
        if cache_dir is not None:
            folder = Path(cache_dir) / self.cache_key()
            paths = cached_shards(folder, len(data), self._extract, shard_size=config.shard_size, progress=progress,
                                  desc="vision features", keep=False)
            self.cached = ShardedRows(paths, config.shard_size)

    def cache_key(self) -> str:
        settings, encoder = self.aligner.settings, self.aligner.encoder
        # the vision tower by its files' content (its first weights alone missed a checkpoint that keeps them)
        files = model_files_digest(settings.vision_model, settings.vision_revision)
        return signature("msd-aligner-patches-v2", settings.vision_model, settings.vision_revision, files,
                         str(encoder.dtype), settings.vision_layer, settings.vision_feature,
                         settings.vision_fingerprint, self.data.fingerprint())[:32]

    def _extract(self, start: int, stop: int) -> dict[str, Tensor]:
        part = self.data.subset(range(start, stop))
        rows: list[Tensor | None] = [None] * len(part)
        for batch in iter_batches(part.samples, self.config.extract_batch_size):
            hidden = self._compute(batch).cpu()
            for position, row in zip(batch.indices.tolist(), hidden):
                rows[position] = row
        return {"patches": torch.stack(rows).contiguous()}

    def _compute(self, batch) -> Tensor:
        hidden = self.aligner.vision_hidden(self.aligner.pixel_values(batch.images))
        return hidden[batch.image_index.to(hidden.device)]

    def rows(self, rows: Sequence[int]) -> Tensor:
        if self.cached is not None:
            return self.cached.get("patches", rows)
        return self._compute(to_batch(self.data.samples.subset(list(rows))))


# --- training --------------------------------------------------------------------------------------------------------


def frozen_spec(model: str, revision: str | None, device: str | None, dtype: str | None,
                local_files_only: bool | None, trust_remote_code: bool) -> EncoderSpec:
    """A frozen backbone's spec: bfloat16 on accelerators unless ``dtype`` says otherwise."""
    if dtype is None and loading.resolve_device(device).type != "cpu":
        dtype = "bfloat16"
    return EncoderSpec(model, device, dtype, revision, local_files_only, trust_remote_code)


def build_aligner(settings: AlignerSettings, vision: EncoderSpec, llm_spec: EncoderSpec, seed: int
                  ) -> tuple[LocalAligner, Any]:
    """The frozen backbones (shared), a fresh projector (seeded) and the settings completed from the backbones.
    Returns the trainable aligner and the LLM."""
    encoder = ClipEncoder.shared(vision)
    llm = load_llm(settings, llm_spec.device, llm_spec.dtype, llm_spec.local_files_only, llm_spec.trust_remote_code)
    tokenizer = load_llm_tokenizer(settings.llm, settings.llm_revision, llm_spec.local_files_only,
                                   llm_spec.trust_remote_code)
    config = vision_tower(encoder).config
    settings.vision_hidden_size, settings.vision_layers = int(config.hidden_size), int(config.num_hidden_layers)
    settings.vision_fingerprint = vision_fingerprint(encoder)
    settings.llm_hidden_size, settings.vocab_size = int(llm.config.hidden_size), int(llm.config.vocab_size)
    if not -settings.vision_layers - 1 <= settings.vision_layer <= settings.vision_layers:
        raise ValueError(f"vision_layer {settings.vision_layer} is outside the {settings.vision_layers} layers of "
                         f"{settings.vision_model}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        projector = build_projector(settings.vision_hidden_size, settings.llm_hidden_size)
    projector = projector.to(next(llm.parameters()).device)
    table = llm.get_input_embeddings().weight if settings.text_features == "input_embeddings" else None
    return LocalAligner(settings, encoder, projector, tokenizer, table, llm), llm


class AlignerRun:
    """One training run's trainable parts and the step that updates them."""

    def __init__(self, aligner: LocalAligner, llm: Any, patches: PatchFeatures, config: AlignerConfig, steps: int):
        self.aligner, self.llm, self.patches, self.config, self.total_steps = aligner, llm, patches, config, steps
        device = aligner.device
        self.log_scale = torch.nn.Parameter(torch.tensor(math.log(1 / config.temperature), device=device),
                                            requires_grad=config.learn_temperature)
        params = list(aligner.projector.parameters()) + ([self.log_scale] if config.learn_temperature else [])
        self.opt = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                                     weight_decay=config.weight_decay)

    def tensors(self) -> dict[str, dict[str, Tensor]]:
        return {"projector": self.aligner.projector.state_dict(), "temperature": {"log_scale": self.log_scale}}

    def load(self, tensors: dict[str, dict[str, Tensor]], optimizer: dict | None) -> None:
        self.aligner.projector.load_state_dict(tensors["projector"])
        with torch.no_grad():
            self.log_scale.copy_(tensors["temperature"]["log_scale"])
        if optimizer is not None:
            self.opt.load_state_dict(optimizer)

    def step(self, rows: list[int], global_step: int) -> dict[str, float]:
        """One optimiser step on the pairs ``rows``."""
        config, aligner = self.config, self.aligner
        for group in self.opt.param_groups:
            group["lr"] = config.lr * lr_factor(global_step, self.total_steps, config.warmup_ratio, config.schedule)
        self.opt.zero_grad()
        captions = [self.patches.data.captions[r] for r in rows]
        projected = aligner.project(self.patches.rows(rows))
        # The LLM's activations are freed micro-batch by micro-batch: the losses are taken on a detached copy of
        # the projected patches, whose gradient then flows back through the projector once.
        prefix = projected.detach().requires_grad_(True)
        scale = self.log_scale.exp()
        contrastive = torch.zeros((), device=prefix.device)
        if config.contrastive_weight > 0:
            image = mean_pooled(F.normalize(prefix, dim=-1), torch.ones(prefix.shape[:2], device=prefix.device))
            text = aligner.encode_text_tokens(captions).pooled.to(prefix.device)
            contrastive = contrastive_loss(image, text, scale)
            (config.contrastive_weight * contrastive).backward()
        reconstruction = self._reconstruct(prefix, captions) if config.reconstruction_weight > 0 else 0.0
        projected.backward(prefix.grad)
        self.opt.step()
        with torch.no_grad():
            self.log_scale.clamp_(max=math.log(config.max_logit_scale))
        contrastive, scale = float(contrastive.detach()), float(scale.detach())
        total = config.contrastive_weight * contrastive + config.reconstruction_weight * reconstruction
        return {"loss": total, "contrastive": contrastive, "reconstruction": reconstruction, "logit_scale": scale}

    def _reconstruct(self, prefix: Tensor, captions: list[str]) -> float:
        """Eq. 5 over the batch (the mean NLL per caption token), back-propagated micro-batch by micro-batch."""
        settings, tokenizer = self.aligner.settings, self.aligner.tokenizer
        bos = tokenizer.bos_token_id
        room = settings.max_length - prefix.shape[1] - (bos is not None)
        ids = caption_ids(tokenizer, captions, settings.caption_suffix, room)
        count = sum(len(x) for x in ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        total = 0.0
        size = self.config.micro_batch_size
        for start in range(0, len(ids), size):
            nll, _ = reconstruction_nll(self.llm, bos, prefix[start:start + size], ids[start:start + size], pad)
            (self.config.reconstruction_weight * nll / count).backward()
            total += float(nll.detach())
        return total / count


def run_signature(settings: AlignerSettings, config: AlignerConfig, data: CaptionSet) -> str:
    relevant = {k: v for k, v in dataclasses.asdict(config).items() if k not in OPERATIONAL}
    return signature("msd-aligner", settings.to_dict(), relevant, data.fingerprint())


def train_aligner(out_dir: str | os.PathLike, data: CaptionSet, *, settings: AlignerSettings | None = None,
                  config: AlignerConfig | None = None, device: str | None = None, dtype: str | None = None,
                  local_files_only: bool | None = None, trust_remote_code: bool = False,
                  cache_dir: str | os.PathLike | None = None, progress: bool = True, overwrite: bool = False,
                  on_step_end: Callable[[int], None] | None = None) -> Path:
    """Train an aligner on ``data`` and write it to ``out_dir`` (see :mod:`.model` for the directory).

    The backbones are ``settings.vision_model`` and ``settings.llm`` (hub ids or local paths), loaded frozen on
    ``device`` (default: CUDA if available) in ``dtype`` (default: bfloat16 on GPU, float32 on CPU). With
    ``cache_dir`` the vision features are extracted once into it. Interrupted runs continue where they stopped
    when called again with the same arguments."""
    settings = dataclasses.replace(settings or AlignerSettings())
    config = config or AlignerConfig()
    vision = frozen_spec(settings.vision_model, settings.vision_revision, device, dtype, local_files_only,
                         trust_remote_code)
    llm_spec = frozen_spec(settings.llm, settings.llm_revision, device, dtype, local_files_only, trust_remote_code)
    aligner, llm = build_aligner(settings, vision, llm_spec, config.seed)
    run_id = run_signature(settings, config, data)
    state, loaded = start_or_resume(out_dir, run_id, overwrite, finished=CONFIG_FILE, what="MSD aligner")
    steps_per_epoch = math.ceil(len(data) / config.batch_size)
    patches = PatchFeatures(aligner, data, config, cache_dir, progress)
    run = AlignerRun(aligner, llm, patches, config, steps_per_epoch * config.epochs)
    record = step_record(run_id, method="msd-aligner")
    if loaded is not None:
        record, tensors, optimizer = loaded
        run.load(tensors, optimizer)

    def end_epoch() -> dict[str, Any]:
        last = record["losses"][-steps_per_epoch:]
        return {f"mean_{k}": sum(x[k] for x in last) / len(last) for k in ("loss", "contrastive", "reconstruction")}

    checkpointing = config.gradient_checkpointing and hasattr(llm, "gradient_checkpointing_enable")
    if checkpointing:
        llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        llm.train()  # transformers checkpoints only in training mode; the LLaMA family has no dropout
    try:
        run_steps(record, samples=len(data), batch_size=config.batch_size, epochs=config.epochs, seed=config.seed,
                  save_every=config.save_every, step=run.step, save=lambda: state.save(record, run.tensors(),
                                                                                       run.opt.state_dict()),
                  end_epoch=end_epoch, on_step_end=on_step_end, progress=progress, desc="msd aligner")
    finally:
        if checkpointing:
            llm.gradient_checkpointing_disable()
            llm.eval()
    record.update(config=dataclasses.asdict(config), train_samples=len(data),
                  logit_scale=float(run.log_scale.detach().exp()))
    return save_aligner(out_dir, settings, aligner.projector, aligner.tokenizer, aligner.token_table, record)


def save_aligner(path: str | os.PathLike, settings: AlignerSettings, projector: torch.nn.Linear, tokenizer: Any,
                 token_table: Tensor | None = None, record: dict[str, Any] | None = None) -> Path:
    """Write an aligner directory (see :mod:`capeval_plugins.models.msd_aligner.model`); files are replaced atomically."""
    if settings.text_features == "input_embeddings" and token_table is None:
        raise ValueError("an 'input_embeddings' aligner needs the LLM's input-embedding table")
    out = output_folder(path)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in projector.state_dict().items()}
    out.write(PROJECTOR_FILE, tensor_bytes(state))
    if settings.text_features == "input_embeddings":
        out.write(TOKENS_FILE, tensor_bytes({"weight": token_table}))
    with out.staging() as staged:  # the tokenizer writes by path: into a private folder, then moved in
        tokenizer.save_pretrained(str(staged / TOKENIZER_DIR))
    out.write(CONFIG_FILE, json_bytes({"format": FORMAT, "version": FORMAT_VERSION, "settings": settings.to_dict(),
                                       "training": record or {}}))
    return Path(path)
