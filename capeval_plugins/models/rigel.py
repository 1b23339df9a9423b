"""Rigel's model side, shared by training and the ``rigel`` metric: the paper's prompts, the settings a
checkpoint records, the scorer (an LVLM + the scoring head on its final hidden state at the score position)
and the checkpoint directory.

A checkpoint is a directory::

    rigel_config.json     format, base model, labels, the four prompts, temperature, head shape, video input,
                          LoRA settings and the training record
    head.safetensors      the scoring head's weights (absent when the LM head scores: Table 3 row (i))
    adapter/              the LoRA adapter (peft ``save_pretrained``: adapter_config.json,
                          adapter_model.safetensors); absent after phase 1

The scorer needs one forward pass per sample (:meth:`LVLMJudge.prompt_end`): no generation.
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from capeval_plugins.core import heads, jsonio
from capeval_plugins.resources import loading, wholeness
from capeval_plugins.core.bounds import bounded, check_fields
from capeval_plugins.models.lvlm import JudgeSpec, LVLMJudge, PromptEnd, VisualInput, is_video, load_lvlm_processor
from capeval_plugins.core.messages import MissingExtra, install_extra
from capeval_plugins.resources.trained import read_checkpoint_config

DEFAULT_BASE_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
LABELS = ("1", "2", "3", "4", "5")
CONFIG_FILE = "rigel_config.json"
HEAD_FILE = "head.safetensors"
ADAPTER_DIR = "adapter"
FORMAT = "capeval-rigel"
FORMAT_VERSION = 1
PROMPT_LAYOUTS = ("flat", "lines")
PROMPT_KEYS = ("image", "image_ref", "video", "video_ref")
HEADS = ("scoring", "lm")

# --- the prompts of the paper's Appendix G --------------------------------------------------------------------
# One entry per line of the prompt box; {cand} and {refs_text} are the paper's placeholders.


def _prompt_lines(visual: str, with_refs: bool) -> list[str]:
    image = visual == "image"
    what = "image" if image else "video frames"
    content = "image content" if image else "video content"
    lines = [
        f"Evaluate the quality of a {visual} caption based on {what}"
        + (" and reference captions." if with_refs else "."),
        "Evaluation Criteria:",
        "- Score ranges from 1 to 5",
        "- 1: Completely incorrect or irrelevant",
        f"- 5: Perfectly describes the {content}" + (" with all key information" if with_refs else ""),
        "- Penalize redundancies and irrelevant information",
        "- Score 1 if the generated caption contains any hallucination",
        "Evaluation Steps:",
        f"1. Examine the {what} to understand the main content",
        f"2. Assess how accurately the caption describes the {visual}",
        f"3. Compare the generated caption to both {what} and references" if with_refs
        else f"3. Compare the generated caption to {what}",
        "4. Assess coverage of main points and relevance",
        "5. Assign ONE score from 1 to 5",
    ]
    if with_refs:
        lines.append("Reference Captions: {refs_text}")
    return lines + [
        "Generated Caption: {cand}",
        "Please output only a single integer from 1 to 5, without any explanation or formatting.",
        "Your score is",
    ]


def paper_prompts(layout: str = "flat") -> dict[str, str]:
    """The four prompts of Appendix G (``image``, ``image_ref``, ``video``, ``video_ref``). ``"flat"``: the
    text as the paper prints it (lines joined by single spaces); ``"lines"``: one line per item of the box."""
    if layout not in PROMPT_LAYOUTS:
        raise ValueError(f"prompt layout must be one of {PROMPT_LAYOUTS}, got {layout!r}")
    joiner = " " if layout == "flat" else "\n"
    return {f"{visual}{'_ref' if refs else ''}": joiner.join(_prompt_lines(visual, refs))
            for visual in ("image", "video") for refs in (False, True)}


_PLACEHOLDER = re.compile(r"\{(cand|refs_text)\}")


def render_prompt(template: str, candidate: str, references: Sequence[str] | None = None,
                  separator: str = "\n") -> str:
    """The prompt for one sample: captions whitespace-normalised, references joined by ``separator``; one
    substitution pass, so a caption that contains a placeholder's text stays as written."""
    values = {"cand": " ".join(candidate.split()),
              "refs_text": separator.join(" ".join(r.split()) for r in references or ())}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


# --- settings ---------------------------------------------------------------------------------------------------


@dataclass
class RigelSettings:
    """What a Rigel checkpoint is: the base LVLM, the prompts and labels, the head's shape and the LoRA
    settings (JSON in ``rigel_config.json``)."""

    base_model: str = DEFAULT_BASE_MODEL
    revision: str | None = None
    labels: tuple[str, ...] = LABELS
    prompts: dict[str, str] = field(default_factory=paper_prompts)
    reference_separator: str = "\n"
    temperature: float = bounded(1.0, ge=1e-6)  # logits / temperature stay finite
    head_hidden: tuple[int, ...] = (1024, 512)  # each in 1..MAX_WIDTH, at most MAX_LAYERS layers
    head_activation: str = "relu"
    hidden_size: int | None = bounded(None, ge=1, le=2**17)  # the widest LLM hidden states are 16-32K
    video_input: str = "auto"
    video_fps: float | None = bounded(2.0, gt=0, le=1000)
    answer_prefix: str = ""
    lora: dict[str, Any] | None = None
    phase: int = bounded(0, ge=0, le=2)
    # Which head gives the score distribution: "scoring" (the MLP g) or "lm" (the LM head's logits of the label
    # tokens, softmax over them: a checkpoint trained that way has no head file, the paper's Table 3 row (i)).
    head: str = "scoring"

    def __post_init__(self) -> None:
        self.labels = tuple(str(x) for x in self.labels)
        self.head_hidden = head_widths(self.head_hidden)
        missing = [k for k in PROMPT_KEYS if k not in self.prompts]
        if missing:
            raise ValueError(f"Rigel settings lack the prompt(s) {missing}")
        if not 2 <= len(self.labels) <= MAX_LABELS:
            raise ValueError(f"Rigel needs 2 to {MAX_LABELS} labels, got {len(self.labels)}")
        check_fields(self, "Rigel settings")
        if self.head not in HEADS:
            raise ValueError(f"Rigel settings: head must be one of {HEADS}, got {self.head!r}")
        VisualInput(self.video_input, self.video_fps, self.answer_prefix)  # raises on bad video settings

    @property
    def visual_input(self) -> VisualInput:
        return VisualInput(self.video_input, self.video_fps, self.answer_prefix)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["labels"], out["head_hidden"] = list(self.labels), list(self.head_hidden)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RigelSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def build_head(self) -> heads.ScoringHead:
        if self.hidden_size is None:
            raise ValueError("the head's input size (the backbone's hidden size) is not known yet")
        return heads.ScoringHead(self.hidden_size, self.head_hidden, len(self.labels), self.head_activation)


MAX_WIDTH, MAX_LAYERS, MAX_LABELS = 65536, 16, 1000  # far above the paper's (1024, 512) head and 5 labels


def head_widths(value: Any) -> tuple[int, ...]:
    """The head's hidden widths: a list of at most ``MAX_LAYERS`` integers in 1..``MAX_WIDTH`` (checked before
    any layer is built: a crafted ``rigel_config.json`` must not allocate gigabytes)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) > MAX_LAYERS:
        raise ValueError(f"Rigel settings: head_hidden must be a list of at most {MAX_LAYERS} widths, got {value!r}")
    for width in value:
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"Rigel settings: head_hidden widths must be integers in 1..{MAX_WIDTH}, got {width!r}")
    return tuple(value)


# --- the scorer ---------------------------------------------------------------------------------------------------


class RigelModel:
    """An LVLM and Rigel's scoring head on its final hidden state at the score position (the end of the
    prompt). ``states`` runs the backbone once per sample (batched, each image's prefix shared); the head is
    small and runs on the states. A model scored through the LM head (``settings.head == "lm"``) has no
    scoring head (``head`` None)."""

    def __init__(self, judge: LVLMJudge, head: heads.ScoringHead | None, settings: RigelSettings):
        self.judge, self.head, self.settings = judge, head, settings

    def instructions(self, visuals: Sequence[Any], index: Sequence[int], candidates: Sequence[str],
                     references: Sequence[Sequence[str] | None] | None = None) -> list[str]:
        """The paper's prompt for every sample: video or image (a visual given as a list of frames is a video),
        reference-based where the sample has references, else reference-free."""
        refs = references if references is not None else [None] * len(candidates)
        out = []
        for g, candidate, r in zip(index, candidates, refs):
            key = ("video" if is_video(visuals[g]) else "image") + ("_ref" if r else "")
            out.append(render_prompt(self.settings.prompts[key], candidate, r, self.settings.reference_separator))
        return out

    def states(self, visuals: Sequence[Any], index: Sequence[int] | Tensor, candidates: Sequence[str],
               references: Sequence[Sequence[str] | None] | None = None, *, batch_size: int = 16,
               grad: bool = False) -> PromptEnd:
        """Final hidden states and score-token log-probabilities at the score position, one forward pass per
        sample."""
        index = index.tolist() if isinstance(index, Tensor) else list(index)
        prompts = self.instructions(visuals, index, candidates, references)
        return self.judge.prompt_end(visuals, index, prompts, self.settings.labels, batch_size=batch_size,
                                     grad=grad, visual_input=self.settings.visual_input)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.head(hidden)

    def label_logits(self, end: PromptEnd, head: str | None = None) -> Tensor:
        """(B, K) logits whose softmax is the score distribution: g(h) for the scoring head; for the LM head
        (``head="lm"``, default ``settings.head``) its label tokens' log-probabilities, whose softmax is the LM
        head's distribution renormalised over the labels."""
        head = head or self.settings.head
        if head == "lm":
            return end.label_logprobs
        if self.head is None:
            raise ValueError("this Rigel model has no scoring head (it was trained against the LM head): score it "
                             "with head='lm'")
        return self.logits(end.hidden)

    def probabilities(self, visuals: Sequence[Any], index: Sequence[int] | Tensor, candidates: Sequence[str],
                      references: Sequence[Sequence[str] | None] | None = None, *,
                      batch_size: int = 16, head: str | None = None) -> Tensor:
        """softmax(g(h)) per sample (B, K), float64, on the CPU (the LM head's label distribution for
        ``head="lm"``; default: the head the model was trained with)."""
        with torch.inference_mode():
            end = self.states(visuals, index, candidates, references, batch_size=batch_size)
            return torch.softmax(self.label_logits(end, head).double(), dim=-1).cpu()


def scores_from_probabilities(probs: Tensor) -> tuple[Tensor, Tensor]:
    """(expected label in [1, K], score in [0, 1]) per sample."""
    expected = heads.label_expectation(probs)
    return expected, heads.unit_score(expected, probs.shape[-1])


# --- loading -------------------------------------------------------------------------------------------------------


@contextmanager
def quiet_peft() -> Iterator[None]:
    """peft reads a transformers attribute that transformers 5 deprecates; the warning is theirs, not the
    user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def require_peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise MissingExtra("Rigel's LoRA (phase 2, and scoring with a phase-2 checkpoint) needs peft: "
                          + install_extra("lora")) from err
    return peft


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def safe_adapter_weights(adapter: Path) -> Path:
    """The LoRA adapter's weights, which must be safetensors: peft falls back to a pickled
    ``adapter_model.bin`` through ``torch.load``, which runs arbitrary code with the torch versions (< 2.6)
    this package supports, so such an adapter is refused whatever peft and torch are installed."""
    weights = adapter / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = [p.name for p in adapter.glob("*.bin")] + [p.name for p in adapter.glob("*.pt")]
        found = f" (found {', '.join(sorted(pickled))}: pickled weights are never loaded)" if pickled else ""
        raise loading.ModelLoadError(f"Rigel adapter {adapter} has no {ADAPTER_WEIGHTS}{found}; convert it once in a "
                                     "trusted session (peft: PeftModel.from_pretrained(...).save_pretrained(dir, "
                                     "safe_serialization=True))")
    return weights


def load_private_backbone(spec: JudgeSpec) -> Any:
    """The base LVLM as a model of its own (not the process-wide shared one): LoRA is injected into it in
    place. Loaded like every model (safetensors only, device and dtype resolved once: bfloat16 on GPU)."""
    from transformers import AutoModelForImageTextToText

    if not spec.model:
        raise ValueError("no base model given (a hub id or a local path)")
    return loading.load_spec(AutoModelForImageTextToText, spec, gpu_dtype=torch.bfloat16, share=False)


def hidden_size_of(judge: LVLMJudge) -> int:
    return int(judge.head.weight.shape[1])


def read_settings(checkpoint: str | os.PathLike) -> RigelSettings:
    data = read_checkpoint_config(checkpoint, CONFIG_FILE, FORMAT, FORMAT_VERSION, "Rigel checkpoint",
                                  "make one with `capeval train rigel --phase 1 ...`")
    return RigelSettings.from_dict(data["settings"])


def read_record(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The training record a checkpoint keeps (history, data, hyper-parameters)."""
    data = jsonio.loads((Path(checkpoint) / CONFIG_FILE).read_text(encoding="utf-8"))
    return data.get("training", {})


def load_head(checkpoint: str | os.PathLike, settings: RigelSettings, device: Any = "cpu") -> heads.ScoringHead | None:
    """The checkpoint's scoring head (None for a checkpoint trained against the LM head)."""
    from capeval_plugins.resources import tensorfile

    if settings.head == "lm":
        return None

    path = Path(checkpoint) / HEAD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"Rigel checkpoint {checkpoint} has no {HEAD_FILE}")
    found = {name: shape for name, (_, shape) in tensorfile.check_file(path).items()}
    with torch.device("meta"):  # the shapes the settings ask for, nothing allocated
        wanted = {name: tuple(t.shape) for name, t in settings.build_head().state_dict().items()}
    if found != wanted:
        differ = sorted(n for n in set(found) | set(wanted) if found.get(n) != wanted.get(n))
        raise tensorfile.TensorFileError(
            f"{path} does not hold the head {CONFIG_FILE} describes ({differ[0]}: {found.get(differ[0])} in the file, "
            f"{wanted.get(differ[0])} in the settings)")
    tensors = tensorfile.load_file(path)
    problem = wholeness.tensors_problem(tensors, wanted, str(path))  # now every value too: finite
    if problem:
        raise loading.ModelLoadError(problem)
    head = settings.build_head()
    head.load_state_dict(tensors)
    return head.to(device).eval().requires_grad_(False)


def adapter_problem(model: Any, adapter: Path) -> str | None:
    """Why the LoRA weights peft put into ``model`` are not exactly the adapter file's (peft fills a factor the
    file lacks with its initial value and scores on: lora_B is zero, so the adapter silently does nothing), or
    holds a value that is not finite or a factor of only zeros (:func:`wholeness.zeroed`); None when whole."""
    from capeval_plugins.resources import tensorfile

    path = adapter / ADAPTER_WEIGHTS
    found = {name: shape for name, (_, shape) in tensorfile.check_file(path).items()}
    names = getattr(model, "peft_config", {}) or {"default": None}
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    wanted = {}
    for name, parameter in lora.items():
        for adapter_name in names:
            name = name.replace(f".{adapter_name}.", ".")
        wanted[name] = tuple(parameter.shape)
    problem = wholeness.tensors_problem(found, wanted, str(path))
    broken = next((n for n, p in zip(wanted, lora.values()) if not wholeness.finite(p)), None)
    zeros = next((n for n, p in zip(wanted, lora.values()) if wholeness.zeroed(n, p)), None)
    return problem or (f"{path}: {broken} holds NaN or infinite values (a damaged file?)" if broken else None) or (
        wholeness.zeroed_message(str(path), zeros) if zeros else None)


def load_rigel(checkpoint: str | os.PathLike, *, model: str | None = None, device: str | None = None,
               dtype: str | None = None, revision: str | None = None, local_files_only: bool | None = None,
               trust_remote_code: bool = False, merge_lora: bool = True, device_map: Any = None,
               max_memory: Any = None, offload_folder: str | None = None) -> RigelModel:
    """A trained Rigel (shared per process and arguments). ``model`` replaces the base model the checkpoint
    names (e.g. a local copy of it). A phase-2 adapter is applied to a model of its own, merged into its
    weights unless ``merge_lora=False``; a phase-1 checkpoint uses the shared backbone. ``device_map``,
    ``max_memory`` and ``offload_folder`` place the backbone (:mod:`capeval_plugins.resources.loading`)."""
    adapter = Path(checkpoint) / ADAPTER_DIR
    if adapter.is_dir():
        safe_adapter_weights(adapter)  # before anything loads
    settings = read_settings(checkpoint)
    spec = JudgeSpec(model or settings.base_model, device, dtype, revision or settings.revision, local_files_only,
                     trust_remote_code, device_map, max_memory, offload_folder)
    key = ("rigel", os.path.realpath(checkpoint), spec, merge_lora)

    def build() -> RigelModel:
        if adapter.is_dir():
            peft = require_peft()
            with quiet_peft(), loading.loader_boundary("Rigel adapter", adapter):
                backbone = peft.PeftModel.from_pretrained(load_private_backbone(spec), str(adapter))
                problem = adapter_problem(backbone, adapter)
                if problem:
                    raise loading.ModelLoadError(f"cannot load Rigel adapter {str(adapter)!r}: {problem}")
            backbone = backbone.merge_and_unload() if merge_lora else backbone.get_base_model()
            judge = LVLMJudge(backbone.eval(), load_lvlm_processor(spec), spec.device)
        else:
            judge = LVLMJudge.shared(spec)
        if settings.hidden_size not in (None, hidden_size_of(judge)):
            raise ValueError(f"the checkpoint's head reads hidden states of size {settings.hidden_size}, but "
                             f"{spec.model} has {hidden_size_of(judge)}: wrong base model")
        return RigelModel(judge, load_head(checkpoint, settings, judge.device), settings)

    def checked() -> RigelModel:
        with loading.loader_boundary("Rigel checkpoint", checkpoint):
            return build()

    return loading.shared(key, checked, (checkpoint,))
