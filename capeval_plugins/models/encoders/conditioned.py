"""Image-conditioned text token embeddings: text tokens that attend to the image, at a chosen layer.

Three families are supported:

- ViLT (``dandelin/vilt-b32-mlm`` and other ViLT checkpoints): one transformer over text tokens and image
  patches. ViLT draws its image patches at random, even in eval mode (a random order of all patches, or a
  random subset when ``max_image_length`` is set). Here each image's patch embedding is drawn once, alone,
  from a generator seeded with ``seed``, so a score is reproducible and does not depend on which other
  images share the batch; the drawn patches are then shared by every text scored against that image.
- BLIP's image-grounded text encoder (``Salesforce/blip-itm-base-coco`` and the other ``blip-itm-*``): a BERT
  whose every block cross-attends to the ViT's patch embeddings, as in ``BlipForImageTextRetrieval`` with
  its ITM head. The ViT runs once per image.

- ViLBERT (a folder written by ``capeval convert vilbert``): the two-stream model of
  :mod:`capeval_plugins.models.encoders.vilbert` on precomputed region features. Each image's regions (with the
  "global" region and box locations) are embedded once; the text stream is read after a co-attention layer.

Layers are numbered as ``hidden_states``: 0 is the embedding layer, k the output of block k, -1 the last; for
ViLBERT the blocks are the co-attention layers (0: the text stream entering the first one, k: after the k-th).
ViLT is pre-LayerNorm: its blocks' outputs are un-normalised residual streams and only the last gets the
model's final LayerNorm; ``final_norm`` applies that LayerNorm to whichever layer is chosen (BLIP's and
ViLBERT's blocks end in their own LayerNorm; the option does not apply).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from capeval_plugins.resources import loading
from capeval_plugins.models.encoders.common import EncoderSpec
from capeval_plugins.models.encoders.text import (TokenEmbeddings, concat_padded, hidden_state_at, length_order,
                                                  pad_rows, resolve_layer)
from capeval_plugins.core.messages import warn_once
from capeval_plugins.image_sources import InputError


@dataclass
class ImageContext:
    """What the text side attends to, one row per distinct image: ``embeddings`` (N, T, D) and ``mask``
    (N, T) (ViLT: the sampled patch embeddings; BLIP: the ViT's output)."""

    embeddings: Tensor
    mask: Tensor

    def __len__(self) -> int:
        return self.embeddings.shape[0]


class ConditionedEncoder:
    """Base of the image-conditioned text encoders: tokenisation, chunking and layer selection."""

    family = ""

    def __init__(self, spec: EncoderSpec, layer: int = -1, final_norm: bool = True, max_tokens: int | None = None):
        self.spec = spec
        self.final_norm = final_norm
        self.processor = loading.load_processor(self.processor_loader(), spec.model, **spec.hub())
        self.tokenizer = self.processor.tokenizer
        self.model = loading.load_spec(self.model_loader(), spec)
        self.device = loading.input_device(self.model, spec.device)
        self.dtype = next(self.model.parameters()).dtype
        self.blocks = self.text_blocks()
        self.layer = self.resolve_layer(layer)
        limit = int(self.text_config().max_position_embeddings)
        self.max_tokens = limit if max_tokens is None else min(int(max_tokens), limit)

    @staticmethod
    def shared(spec: EncoderSpec, family: str | None = None, **options: Any) -> "ConditionedEncoder":
        """The encoder of ``spec.model``'s family, built once per process per setting; ``family`` (if given) must
        be the checkpoint's. ``options`` are the family's constructor arguments (``layer``, ``max_tokens``; ViLT:
        ``final_norm``, ``seed``, ``max_image_patches``; ViLBERT: ``task_id``, ``after_text_layer``)."""
        found = model_family(spec)
        if family is not None and family != found:
            raise ValueError(f"{spec.model} is a {found} checkpoint, not {family}")
        cls = {"vilt": ViltConditioned, "blip": BlipConditioned, "vilbert": ViLBertConditioned}[found]
        key = (cls.__name__, spec, tuple(sorted(options.items())))
        return loading.shared(key, lambda: cls(spec, **options))

    # --- per family ---------------------------------------------------------------------------------------
    def processor_loader(self) -> Any:
        from transformers import AutoProcessor

        return AutoProcessor

    def model_loader(self) -> Any:
        raise NotImplementedError

    def text_blocks(self) -> torch.nn.ModuleList:
        raise NotImplementedError

    def text_config(self) -> Any:
        raise NotImplementedError

    def encode_images(self, images: Sequence[Any]) -> ImageContext:
        raise NotImplementedError

    def text_hidden(self, input_ids: Tensor, attention_mask: Tensor, image: Tensor, image_mask: Tensor) -> Tensor:
        raise NotImplementedError

    def resolve_layer(self, layer: int) -> int:
        return resolve_layer(layer, len(self.blocks), self.spec.model)

    def output_tokens(self, input_ids: Tensor, mask: Tensor, special: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Ids, mask and special-token flags of the positions ``text_hidden`` returns (the input's, unless the
        model adds positions of its own)."""
        return input_ids, mask, special

    # --- shared -------------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Ids and special-token masks; captions over the text limit are truncated keeping [SEP], with a
        warning (once per model)."""
        texts = [t.strip() for t in texts]
        out = self.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=self.max_tokens,
                             return_special_tokens_mask=True)
        full = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        too_long = sum(len(row) > self.max_tokens for row in full)
        if too_long:
            warn_once(
                ("truncate", self.spec.model),
                f"{too_long} caption(s) exceed the {self.max_tokens}-token text limit of {self.spec.model}; they "
                "are truncated keeping the closing [SEP] (reported once per model)",
            )
        return [list(r) for r in out["input_ids"]], [list(r) for r in out["special_tokens_mask"]]

    @torch.inference_mode()
    def embed(self, texts: Sequence[str], image_rows: Tensor, context: ImageContext,
              batch_size: int = 64) -> TokenEmbeddings:
        """Token embeddings of each text conditioned on image ``context[image_rows[i]]``; special tokens are
        flagged in ``special``. Texts run in chunks of ``batch_size`` of similar length."""
        if not texts:
            raise ValueError("no texts to embed")
        ids, special = self.tokenize(texts)
        order = length_order([len(r) for r in ids])
        pad_id = self.tokenizer.pad_token_id or 0
        chunks = []
        for start in range(0, len(order), max(1, batch_size)):
            pick = order[start : start + batch_size]
            input_ids, mask = pad_rows([ids[i] for i in pick], pad_id)
            special_mask, _ = pad_rows([special[i] for i in pick], 1)
            rows = image_rows[torch.tensor(pick, dtype=torch.long)].to(context.embeddings.device)
            hidden = self.text_hidden(input_ids.to(self.device), mask.to(self.device),
                                      context.embeddings[rows], context.mask[rows])
            input_ids, mask, special_mask = self.output_tokens(input_ids, mask, special_mask.bool())
            chunks.append(TokenEmbeddings(hidden.float(), input_ids.to(self.device), mask.to(self.device),
                                          special_mask.to(self.device)))
        return concat_padded(chunks, order)


FAMILIES = ("vilt", "blip", "vilbert")


def _file_kwargs(revision: str | None, local_files_only: bool | None) -> dict[str, Any]:
    """Where to read a checkpoint's small files from (no remote code is involved in reading a config)."""
    hub = loading.hub_kwargs(revision, local_files_only, False)
    hub.pop("trust_remote_code")
    return hub


def model_family(spec: EncoderSpec) -> str:
    """``"vilt"``, ``"blip"`` or ``"vilbert"``, from the checkpoint's ``config.json`` (no weights are read)."""
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(spec.model, **_file_kwargs(spec.revision, spec.local_files_only))
    family = config.get("model_type", "")
    if family not in FAMILIES:
        raise ValueError(f"{spec.model}: model type {family!r} is not an image-conditioned text encoder supported "
                         "here (ViLT, e.g. dandelin/vilt-b32-mlm; BLIP ITM, e.g. Salesforce/blip-itm-base-coco; or a "
                         "ViLBERT folder written by `capeval convert vilbert`)")
    return family


class ViltConditioned(ConditionedEncoder):
    """ViLT: text tokens and (seeded) image patches in one transformer."""

    family = "vilt"

    def __init__(self, spec: EncoderSpec, layer: int = -1, final_norm: bool = True, seed: int = 0,
                 max_image_patches: int | None = None, max_tokens: int | None = None):
        super().__init__(spec, layer, final_norm, max_tokens)
        self.seed = seed
        configured = self.model.config.max_image_length
        self.max_image_patches = configured if max_image_patches is None else max_image_patches

    def model_loader(self) -> Any:
        from transformers import ViltModel

        return ViltModel

    def text_blocks(self) -> torch.nn.ModuleList:
        return self.model.encoder.layer

    def text_config(self) -> Any:
        return self.model.config

    @torch.inference_mode()
    def encode_images(self, images: Sequence[Any]) -> ImageContext:
        pixels = self._pixels(list(images))
        values = pixels["pixel_values"].to(self.device, self.dtype)
        masks = pixels["pixel_mask"].to(self.device)
        embedded = [self._patches(values[i : i + 1], masks[i : i + 1]) for i in range(len(values))]
        width = max(e.shape[1] for e, _ in embedded)
        out = torch.zeros((len(embedded), width, embedded[0][0].shape[-1]), dtype=self.dtype, device=self.device)
        mask = torch.zeros((len(embedded), width), dtype=torch.long, device=self.device)
        for i, (e, m) in enumerate(embedded):
            out[i, : e.shape[1]] = e[0]
            mask[i, : m.shape[1]] = m[0]
        return ImageContext(out, mask)

    def _pixels(self, images: list[Any]) -> Any:
        """ViLT's image processor over ``images``. It scales the shorter side to its size and caps the longer, then
        rounds both down to whole patches: an image elongated past about 20:1 comes out 0 pixels wide and the
        processor raises. Alone, such an image is this sample's problem (one line naming it); in a batch, the
        session scores the samples apart to find it."""
        try:
            return self.processor.image_processor(images=images, return_tensors="pt")
        except ValueError as err:
            if len(images) != 1 or not hasattr(images[0], "size"):
                raise
            width, height = images[0].size
            raise InputError(f"ViLT's image processor cannot take this {width} x {height} image, too elongated for "
                             f"its resize ({' '.join(str(err).split())[:120]})") from None

    def _patches(self, pixel_values: Tensor, pixel_mask: Tensor) -> tuple[Tensor, Tensor]:
        # ViLT samples patches with torch.multinomial on CPU tensors: draw them for this image alone, from a
        # seeded generator, leaving the caller's random state untouched.
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(self.seed)
            embeds, mask, _ = self.model.embeddings.visual_embed(
                pixel_values, pixel_mask, max_image_length=self.max_image_patches
            )
        return embeds, mask

    def text_hidden(self, input_ids: Tensor, attention_mask: Tensor, image: Tensor, image_mask: Tensor) -> Tensor:
        hidden = hidden_state_at(
            self.model, self.blocks, self.layer, input_ids=input_ids, attention_mask=attention_mask.long(),
            token_type_ids=torch.zeros_like(input_ids), image_embeds=image, pixel_mask=image_mask,
        )
        text = hidden[:, : input_ids.shape[1]]
        return self.model.layernorm(text) if self.final_norm else text


class BlipConditioned(ConditionedEncoder):
    """BLIP's image-grounded text encoder (the ITM branch of ``BlipForImageTextRetrieval``)."""

    family = "blip"

    def __init__(self, spec: EncoderSpec, layer: int = -1, max_tokens: int | None = None):
        super().__init__(spec, layer, final_norm=True, max_tokens=max_tokens)

    def model_loader(self) -> Any:
        from transformers import BlipForImageTextRetrieval

        return BlipForImageTextRetrieval

    def text_blocks(self) -> torch.nn.ModuleList:
        return self.model.text_encoder.encoder.layer

    def text_config(self) -> Any:
        return self.model.config.text_config

    @torch.inference_mode()
    def encode_images(self, images: Sequence[Any]) -> ImageContext:
        pixels = self.processor.image_processor(images=list(images), return_tensors="pt")["pixel_values"]
        embeds = self.model.vision_model(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
        return ImageContext(embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device))

    def text_hidden(self, input_ids: Tensor, attention_mask: Tensor, image: Tensor, image_mask: Tensor) -> Tensor:
        return hidden_state_at(
            self.model.text_encoder, self.blocks, self.layer, input_ids=input_ids,
            attention_mask=attention_mask.long(), encoder_hidden_states=image, encoder_attention_mask=image_mask,
        )


class WordPieceOnly:
    """ViLBERT's processor: the BERT WordPiece tokenizer alone (its images are region features, read elsewhere),
    from the model folder or the ``tokenizer_source`` its config names."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, name_or_path: str, revision: str | None = None, local_files_only: bool | None = None,
                        trust_remote_code: bool = False) -> "WordPieceOnly":
        from transformers import BertTokenizerFast

        from capeval_plugins.models.encoders.vilbert import ViLBertConfig

        where = _file_kwargs(revision, local_files_only)
        config = ViLBertConfig.from_pretrained(name_or_path, **where)
        source = config.tokenizer_source or name_or_path
        if config.tokenizer_source:
            where.pop("revision", None)  # the model's revision, not the tokenizer's
        tokenizer = BertTokenizerFast.from_pretrained(source, **where)
        if len(tokenizer) != config.vocab_size:  # a folder without tokenizer files loads as an empty vocabulary
            raise ValueError(f"{name_or_path}: the tokenizer from {source} has {len(tokenizer)} word pieces but the "
                             f"model {config.vocab_size}; convert with `capeval convert vilbert --tokenizer` pointing "
                             "at bert-base-uncased's files")
        return cls(tokenizer)


# The official ViLBERTScore script: task token 7 ("Retrieval COCO") with the multi-task model, captions cut to 37
# tokens.
OFFICIAL_TASK_ID = 7
OFFICIAL_MAX_TOKENS = 37


class ViLBertConditioned(ConditionedEncoder):
    """ViLBERT on region features: the text stream after a co-attention layer. ``task_id``: None for the official
    choice (7 with a multi-task checkpoint, no task token without one), -1 for no task token, else the token."""

    family = "vilbert"

    def __init__(self, spec: EncoderSpec, layer: int = -1, task_id: int | None = None,
                 after_text_layer: bool = False, max_tokens: int | None = None):
        super().__init__(spec, layer, final_norm=True,
                         max_tokens=OFFICIAL_MAX_TOKENS if max_tokens is None else max_tokens)
        n_tasks = self.model.config.num_task_tokens
        if task_id is None:
            task_id = OFFICIAL_TASK_ID if n_tasks else -1
        if task_id != -1 and not 0 <= task_id < n_tasks:
            raise ValueError(f"{spec.model}: task_id {task_id} does not exist (the model has "
                             + (f"task tokens 0..{n_tasks - 1}; -1 for none)" if n_tasks else "no task tokens; use -1)"))
        self.task_id = None if task_id == -1 else task_id
        if after_text_layer and self.layer == 0:
            raise ValueError("after_text_layer reads the text layer after a co-attention layer: use layer 1 or above")
        self.after_text_layer = after_text_layer

    def processor_loader(self) -> Any:
        return WordPieceOnly

    def model_loader(self) -> Any:
        from capeval_plugins.models.encoders.vilbert import ViLBertModel

        return ViLBertModel

    def text_blocks(self) -> torch.nn.ModuleList:
        return self.model.encoder.c_layer

    def text_config(self) -> Any:
        return self.model.config

    def resolve_layer(self, layer: int) -> int:
        n = len(self.blocks)
        if not -n <= layer <= n:
            raise ValueError(f"{self.spec.model}: layer {layer} does not exist; ViLBERT's text stream is read after "
                             f"co-attention layer 1..{n} (or -1..-{n} from the end; 0: before the first)")
        return layer + n + 1 if layer < 0 else layer

    @torch.inference_mode()
    def encode_images(self, images: Sequence[Any]) -> ImageContext:
        from capeval_plugins.resources.regions import RegionFeatures, with_global_region

        want = self.model.config.v_feature_size
        inputs = []
        for regions in images:
            if not isinstance(regions, RegionFeatures):
                raise TypeError(f"ViLBERT reads precomputed region features, got {type(regions).__name__} "
                                "(give vilbertscore a features folder)")
            if regions.features.shape[1] != want:
                raise ValueError(f"region features of width {regions.features.shape[1]}; {self.spec.model} takes {want}")
            inputs.append(with_global_region(regions))
        width = max(len(f) for f, _ in inputs)
        features = torch.zeros((len(inputs), width, want))
        locations = torch.zeros((len(inputs), width, 5))
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for i, (f, loc) in enumerate(inputs):
            features[i, : len(f)] = torch.from_numpy(f)
            locations[i, : len(f)] = torch.from_numpy(loc)
            mask[i, : len(f)] = 1
        embedded = self.model.embed_regions(features.to(self.device, self.dtype), locations.to(self.device, self.dtype))
        return ImageContext(embedded, mask.to(self.device))

    def text_hidden(self, input_ids: Tensor, attention_mask: Tensor, image: Tensor, image_mask: Tensor) -> Tensor:
        task = None if self.task_id is None else torch.full((len(input_ids),), self.task_id, device=input_ids.device)
        text, text_mask = self.model.text_inputs(input_ids, attention_mask, task)
        return self.model.text_at(self.layer, text, text_mask, image, image_mask, self.after_text_layer)

    def output_tokens(self, input_ids: Tensor, mask: Tensor, special: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # The task slot after [CLS] is a real, matched position (as in the official script); its id is -1.
        if self.task_id is None:
            return input_ids, mask, special
        column = lambda t, value: torch.cat([t[:, :1], torch.full_like(t[:, :1], value), t[:, 1:]], dim=1)  # noqa: E731
        return column(input_ids, -1), column(mask, True), column(special, False)
