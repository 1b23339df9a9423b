"""MID: Mutual Information Divergence (Kim et al., NeurIPS 2022), for image captioning.

A joint Gaussian is fitted to L2-normalised CLIP features of (image, reference caption) pairs of the corpus;
each (image, candidate caption) pair is scored by its point-wise mutual information under that fit. The corpus
MID is the official code's trace form by default, or the mean PMI (``corpus_reduction``). The fit is kept as
summed statistics (O(D^2) state whatever the corpus size, merged across batches and DDP ranks). With
``per_sample=True`` (default) each candidate pair's features are kept too, for its PMI; with ``per_sample=False``
only the candidate pairs' sums are, so the whole state and a DDP sync are O(D^2).
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor

from capeval_plugins.contract import (INDEX, Batch, CorpusSize, FitProblem, Metric, MetricInfo, MetricResult,
                                      ModelConfig, StateSpec, bounded)
from capeval_plugins.core import gaussian
from capeval_plugins.digests import cached_commit, model_files_digest
from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec
from capeval_plugins.models.encoders.clip import dual_encoder_problem
from capeval_plugins.models.encoders.openai_clip import OfficialClip, check_preprocessing, fed
from capeval_plugins.core.messages import DataError, warn_once
from capeval_plugins.resources import loading

CITATION = """@inproceedings{kim2022mutual,
  title     = {Mutual Information Divergence: A Unified Metric for Multimodal Generative Models},
  author    = {Kim, Jin-Hwa and Kim, Yunji and Lee, Jiyoung and Yoo, Kang Min and Lee, Sang-Woo},
  booktitle = {Advances in Neural Information Processing Systems},
  volume    = {35},
  pages     = {35072--35086},
  year      = {2022}
}"""

FIT_PAIRS = ("all_references", "first_reference")
# State names: the reference fit's sums; the candidate pairs' features (per_sample) or their sums (not).
FIT = {k: f"fit_{k}" for k in gaussian.SUM_KEYS}
SCORED = {k: f"candidate_{k}" for k in gaussian.SUM_KEYS}
IMAGE, TEXT = "image_features", "candidate_features"


@dataclass
class MIDConfig(ModelConfig):
    model: str = "openai/clip-vit-large-patch14"
    # Added to the diagonal of the fitted covariance (official MID: 0; Redemption Score's code: 5e-4). The features
    # are unit vectors, so every eigenvalue of their covariance is at most 1 (its trace is): a ridge above 1 swamps
    # every direction and MID tends to a constant (1e308 overflowed).
    covariance_eps: float = bounded(0.0, ge=0, le=1)
    # A reference Gaussian saved by MID.fit_reference: score against it instead of fitting on this corpus.
    reference_gaussian: str | None = None
    input_paths: ClassVar[tuple[str, ...]] = ("model", "reference_gaussian")
    # Which (image, reference) pairs of a sample enter the fit.
    fit_pairs: str = "all_references"
    # Corpus MID: "trace" (the official code's reduced output, what published MID numbers are) or "mean" (the
    # mean of the per-sample PMI).
    corpus_reduction: str = "trace"
    # False: no per-sample PMI; only sums of the candidate pairs are kept (state and DDP sync O(D^2), not O(N D)).
    per_sample: bool = True
    # "official": CLIP fed as OpenAI's clip package feeds it, as the official code does (clip.load, and
    # clip.tokenize's ftfy and HTML unescaping); "transformers": the checkpoint's processor and tokenizer (what
    # Redemption Score's code feeds its MID part). See the card for the official code's text-to-image transform.
    preprocessing: str = "official"

    def __post_init__(self) -> None:
        check_preprocessing("mid", self.preprocessing)
        if self.fit_pairs not in FIT_PAIRS:
            raise ValueError(f"fit_pairs must be one of {FIT_PAIRS}, got {self.fit_pairs!r}")
        if self.corpus_reduction not in gaussian.REDUCTIONS:
            raise ValueError(f"corpus_reduction must be one of {gaussian.REDUCTIONS}, got {self.corpus_reduction!r}")


class MID(Metric):
    info = MetricInfo(
        name="mid",
        display_name="MID",
        description=(
            "Mutual Information Divergence: the point-wise mutual information of (image, candidate) CLIP features "
            "under a joint Gaussian fitted to the corpus's (image, reference) pairs; the corpus value in the "
            "official code's trace form."
        ),
        citation=CITATION,
        references="optional",  # needed unless a saved reference Gaussian is given
        images="always",
        score_range=None,
        paper="https://arxiv.org/abs/2205.13445",
        paper_config={"model": "openai/clip-vit-large-patch14", "covariance_eps": 0.0, "corpus_reduction": "trace"},
        codebase_urls=("https://github.com/naver-ai/mid.metric",),
    )
    Config = MIDConfig
    model_kind_problem = staticmethod(dual_encoder_problem)  # a --model shared by several metrics, checked unloaded

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self._saved = load_fit(self.config.reference_gaussian) if self.config.reference_gaussian else None
        self._fit_refusal: str | None = None
        self._checked_encoder: Any = None  # the loaded model the fit was last checked against
        # A hub model not cached yet cannot be identified before it loads: map checks it then.
        self._fit_model_checked = self._saved is None or self._check_fit_model()

    def _check_fit_model(self, loaded: bool = False) -> bool:
        """Refuse a saved fit made on features of other model files, or of another dtype, than this metric's
        (one line, with the fix), whatever the paths; an older fit, which records no digest of its model's files,
        is checked by name only, with a warning. False when the model cannot be identified yet (a hub id not in
        the cache and not ``loaded``)."""
        saved = self._saved.metadata
        fed_as = saved.get("preprocessing", "transformers")  # a fit saved before the option: the processor's
        if fed_as != self.config.preprocessing:
            self._refuse_fit(f"was fitted on features of inputs fed as preprocessing={fed_as!r}, but this metric "
                             f"feeds them as {self.config.preprocessing!r}", f"pass preprocessing={fed_as!r}")
        fitted_pairs = saved.get("fit_pairs")
        if isinstance(fitted_pairs, str) and fitted_pairs != self.config.fit_pairs:  # the fit's sums are its pairs'
            self._refuse_fit(f"was fitted on fit_pairs={fitted_pairs!r}, but this metric selects "
                             f"{self.config.fit_pairs!r}", f"pass fit_pairs={fitted_pairs!r}")
        if not isinstance(saved.get("model_digest"), str):
            self._warn_unverified("the fit records no digest of its model's files (saved by an older version)")
            return True
        if not self._check_fit_files(saved, loaded):
            return False
        fitted_dtype, dtype = saved.get("feature_dtype"), dtype_name(configured_dtype(self.config))
        if fitted_dtype is not None and fitted_dtype != dtype:
            self._refuse_fit(f"was fitted on {fitted_dtype} features of {saved.get('model')}, but this metric "
                             f"computes {dtype} ones", f"pass dtype={fitted_dtype}")
        return True

    def _check_fit_files(self, saved: dict[str, Any], loaded: bool) -> bool:
        """The model's files against the fit's digest (one hub commit: the same files, nothing hashed)."""
        cfg, recorded = self.config, saved["model_digest"]
        commit = hub_commit(cfg.model, cfg.revision)
        if commit is not None and commit == saved.get("model_commit"):
            return True
        given = model_files_digest(cfg.model, cfg.revision)
        if given is None and not loaded:
            return False
        if given is None:  # loaded, yet not in the cache this package reads
            warnings.warn(f"mid: cannot verify that {cfg.model} holds the files the saved reference Gaussian "
                          f"{cfg.reference_gaussian} was fitted on: it is not in the Hugging Face cache", stacklevel=4)
        elif given != recorded:
            self._refuse_fit(f"was fitted on features of {saved.get('model')} (model files {recorded[:12]}), but "
                             f"the model given, {cfg.model}, holds other files ({given[:12]})",
                             "pass the model the fit was made with")
        return True

    def _check_downloaded_fit_model(self) -> None:
        """The check a hub model not cached at load waits for (its download). A refusal is kept: the session
        splits a failed batch in search of a faulty sample, and each part is refused without hashing again."""
        if self._fit_refusal is None:
            try:
                self._fit_model_checked = self._check_fit_model(loaded=True)
                return
            except DataError as err:
                self._fit_refusal = str(err)
        raise DataError(self._fit_refusal)

    def _warn_unverified(self, why: str) -> None:
        """Today's check by name alone, for a fit whose model files cannot be compared."""
        fitted_with = self._saved.metadata.get("model")
        if fitted_with not in (None, self.config.model):
            warnings.warn(f"mid: the reference Gaussian was fitted on features of {fitted_with!r}, but this metric "
                          f"encodes with {self.config.model!r}; {why}, so whether they are the same weights "
                          "cannot be verified (fit again with fit_reference to have it checked)", stacklevel=4)

    def _refuse_fit(self, mismatch: str, fix: str) -> None:
        need = f"the saved reference Gaussian {self.config.reference_gaussian} {mismatch}"
        raise DataError(FitProblem(need, ("fit again with fit_reference", fix)).message(self.info.name))

    @property
    def encoder(self) -> ClipEncoder | OfficialClip:
        return fed(EncoderSpec.from_config(self.config), self.config.preprocessing)

    def references_required(self) -> bool:
        return self._saved is None  # the Gaussian is fitted on the corpus's references

    @property
    def dim(self) -> int:
        """Dimension of one feature (image and text share CLIP's joint space)."""
        if self._saved is not None:
            return self._saved.dim_x
        return feature_dim(self.encoder.model.config)

    def check_corpus(self, size: CorpusSize) -> FitProblem | None:
        """The fit on this corpus's (image, reference) pairs (:meth:`fit_problem`), or a saved fit's dimension
        against the model's, before anything is loaded."""
        if self._saved is None:
            return self.fit_problem(size)
        dim = self._config_dim()
        if dim is not None and dim != self._saved.dim_x:
            return FitProblem(f"the saved reference Gaussian {self.config.reference_gaussian} was fitted on "
                              f"{self._saved.dim_x}-dimensional features, but {self.config.model} gives "
                              f"{dim}-dimensional ones", ("fit it again with this model (MID.fit_reference)",
                                                          "give the model it was fitted with"))
        return None

    def fit_problem(self, size: CorpusSize) -> FitProblem | None:
        """A fit on the (image, reference) pairs of a corpus of ``size`` needs more pairs than joint dimensions
        (2D) unless ``covariance_eps > 0``, and at least 2 pairs in any case. D is read from the model's config
        file, not its weights; a config that cannot be read is left to the model loader."""
        counts = size.reference_counts
        pairs = sum(counts) if self.config.fit_pairs == "all_references" else sum(1 for c in counts if c)
        if pairs < 2:
            return FitProblem(f"its Gaussian fit needs at least 2 (image, reference) pairs, the corpus gives {pairs}",
                              ("score more samples with references",
                               "give reference_gaussian=PATH (a fit saved by MID.fit_reference)"))
        dim = self._config_dim()
        if dim is None or self.config.covariance_eps > 0:
            return None
        fixes = ("score more samples", "give reference_gaussian=PATH (a fit on more pairs)")
        eps = ("covariance_eps", "5e-4")
        if pairs <= 2 * dim:
            return FitProblem(
                f"its Gaussian fit on {self.config.model} features needs more (image, reference) pairs than the "
                f"2D = {2 * dim} joint dimensions for a non-singular covariance, the corpus gives {pairs}", fixes, eps)
        # Each block of the covariance has rank below the number of distinct features in it.
        for what, distinct in (("images", size.distinct_images), ("reference texts", size.distinct_references)):
            if distinct is not None and distinct <= dim:
                return FitProblem(
                    f"its Gaussian fit on {self.config.model} features needs more distinct {what} than the D = "
                    f"{dim} feature dimensions for a non-singular covariance, the corpus has {distinct}", fixes, eps)
        return None

    def _config_dim(self) -> int | None:
        from capeval_plugins.resources.loading import load_config

        cfg = self.config
        try:
            config = load_config(cfg.model, cfg.revision, cfg.local_files_only, cfg.trust_remote_code)
            return feature_dim(config)
        except Exception:  # unreadable here (ModelLoadError, a config without the sizes): the loader reports it
            return None

    def states(self) -> dict[str, StateSpec]:
        d = self.dim
        spec = {FIT[k]: s for k, s in sum_specs(2 * d).items()}
        if not self.config.per_sample:
            return {**spec, **{SCORED[k]: s for k, s in sum_specs(2 * d).items()}}
        # The encoder's float32 unit vectors, kept as they are (cast to float64 at finalize).
        return {**spec, IMAGE: StateSpec("cat", torch.float32, (d,)), TEXT: StateSpec("cat", torch.float32, (d,))}

    def reference_pairs(self, references: Sequence[Sequence[str]]) -> tuple[list[str], list[int]]:
        """Flattened reference texts and the sample each belongs to, as ``fit_pairs`` selects."""
        texts, owner = [], []
        for i, refs in enumerate(references):
            chosen = list(refs) if self.config.fit_pairs == "all_references" else list(refs[:1])
            texts += chosen
            owner += [i] * len(chosen)
        return texts, owner

    def map(self, batch: Batch) -> dict[str, Tensor]:
        enc, n = self.encoder, len(batch)
        if self._saved is not None and self._fit_model_checked and enc is not self._checked_encoder:
            # the process loaded the model again (its files changed since): the fit is checked against them again
            self._fit_model_checked = self._checked_encoder is None
        if not self._fit_model_checked:
            self._check_downloaded_fit_model()
        self._checked_encoder = enc
        fit_refs = self._saved is None
        if fit_refs and batch.references is None:
            raise ValueError(
                "mid needs references to fit its Gaussian on (image, reference) pairs, or a saved fit "
                "(reference_gaussian=PATH, see MID.fit_reference)"
            )
        if not fit_refs and batch.references is not None:
            warn_once(("mid", "saved-fit"), "mid: a saved reference Gaussian is given; references are not fitted")
        ref_texts, owner = self.reference_pairs(batch.references) if fit_refs else ([], [])
        image_feats = enc.encode_images(batch.images)[batch.image_index.to(enc.device)]
        if not fit_refs and image_feats.shape[-1] != self.dim:
            raise ValueError(f"mid: {self.config.model} gives {image_feats.shape[-1]}-dimensional features, but the "
                             f"saved reference Gaussian was fitted on {self.dim}-dimensional ones")
        text_feats = enc.encode_texts(list(batch.candidates) + ref_texts)  # one pass for all texts
        if ref_texts:
            owner_t = torch.tensor(owner, device=image_feats.device)
            sums = gaussian.joint_sums(image_feats[owner_t], text_feats[n:])
        else:
            sums = gaussian.empty_sums(2 * self.dim, device=image_feats.device)
        out = {FIT[k]: v for k, v in sums.items()}
        if not self.config.per_sample:
            scored = gaussian.joint_sums(image_feats, text_feats[:n])
            return {**out, **{SCORED[k]: v for k, v in scored.items()}}
        return {**out, IMAGE: image_feats, TEXT: text_feats[:n]}

    def fitted(self, state: dict[str, Tensor]) -> gaussian.JointGaussian:
        """The reference Gaussian: the saved one if given, else the one fitted on this corpus."""
        if self._saved is not None:
            sums, dim_x = self._saved.sums, self._saved.dim_x
        else:
            sums, dim_x = {k: state[v] for k, v in FIT.items()}, self.dim
        return gaussian.JointGaussian.from_sums(sums, dim_x, self.config.covariance_eps)

    def finalize(self, state: dict[str, Tensor]) -> MetricResult:
        fit = self.fitted(state)
        if fit.count <= fit.dim:  # only reachable with covariance_eps > 0 (else from_sums refuses)
            warn_once(("mid", "few-pairs", fit.count), (
                f"mid: the Gaussian is fitted on {fit.count} pairs for {fit.dim} joint dimensions; the "
                f"covariance is defined only through covariance_eps={self.config.covariance_eps}"))
        corpus = {"mutual_information": fit.mutual_information(), "fit_pairs": float(fit.count)}
        reduction = self.config.corpus_reduction
        if not self.config.per_sample:
            scored = {k: state[v] for k, v in SCORED.items()}
            score = self.defined(lambda: gaussian.corpus_mid(fit, scored, reduction))
            return MetricResult(self.info.name, score, torch.zeros(0, dtype=torch.float64),
                                torch.zeros(0, dtype=torch.int64), corpus_extras=corpus)
        image, text = state[IMAGE].double(), state[TEXT].double()
        pmi = fit.pmi(image, text)
        normalized = gaussian.normalize_pmi(pmi)
        # From the de-duplicated rows: repeats a DDP sampler added do not enter the corpus value.
        score = self.defined(lambda: gaussian.mid(fit, image, text, reduction))
        corpus["mean_pmi_normalized"] = float(normalized.mean()) if len(pmi) else math.nan
        return MetricResult(self.info.name, score, pmi, state[INDEX], extras={"pmi_normalized": normalized},
                            corpus_extras=corpus)

    @staticmethod
    def defined(corpus_value: Callable[[], float]) -> float:
        """The corpus MID, or NaN with a warning where it is undefined (the trace form of a single pair)."""
        try:
            return corpus_value()
        except gaussian.TooFewSamplesError as err:
            warn_once(("mid", "one-pair"), f"mid: the corpus MID is NaN: {err}")
            return math.nan

    def fit_reference(
        self,
        images: Sequence[Any],
        references: Sequence[Any],
        save_to: str | None = None,
        *,
        on_error: str | None = None,
        progress: bool = False,
    ) -> "FitSums":
        """Fit the reference Gaussian on (image, reference) pairs only, e.g. a deduplicated corpus or a
        larger one than a later run scores, and optionally save it for ``reference_gaussian=save_to``.
        Returns the summed statistics. The pairs stream through a session like any corpus: the same checks (a
        fit on too few pairs is refused before the model loads), batches, merge and ``on_error`` policy (this
        call's, else the metric's): under ``"skip"`` the samples left out (an unreadable image) are said in a
        warning, listed in the result's ``skipped`` (``{index: reason}``) and counted in the saved fit's
        header (``n_skipped``)."""
        from capeval_plugins import files, runner

        if save_to is not None:  # refused now, not after the fit: a link, a folder, the model's own files
            files.check_output(save_to, [self.config.model] if os.path.exists(self.config.model) else [], "save_to")
        from capeval_plugins.inputs import InputError

        if references is None:
            raise InputError("fit_reference needs references")
        fit = ReferenceFit(self)
        # each sample's first reference stands for its caption: the fit reads only images and references
        candidates = [r if isinstance(r, str) else (list(r) or [""])[0] for r in references]
        corpus = runner.Corpus(candidates, images, references)
        folded = runner.Session({fit.info.name: fit}, on_error=on_error).fold(corpus, progress=progress)[fit.info.name]
        sums = FitSums({k: folded.state[FIT[k]] for k in gaussian.SUM_KEYS}, folded.skipped)
        if sums.skipped:
            warnings.warn(f"mid: fit_reference left out {len(sums.skipped)} of {len(candidates)} samples "
                          f"({_reasons(sums.skipped)}): the Gaussian is fitted on the other "
                          f"{len(candidates) - len(sums.skipped)}", stacklevel=2)
        if save_to is not None:
            files.write_output(save_to, gaussian.sums_to_bytes(sums, self.dim, **self.fit_identity(),
                                                               fit_pairs=self.config.fit_pairs,
                                                               n_skipped=len(sums.skipped)), what="saved fit")
        return sums

    def fit_identity(self) -> dict[str, Any]:
        """What a saved fit records of its features, for :meth:`_check_fit_model`: the model's name, the digest
        of its files (a copy elsewhere has the same), a hub id's commit, and the dtype it computed in.
        covariance_eps is applied when scoring, not to the saved sums; the inputs are fed as ``preprocessing``
        says (recorded), truncated at the model's own length."""
        cfg = self.config
        return {"model": cfg.model, "model_digest": model_files_digest(cfg.model, cfg.revision),
                "model_commit": hub_commit(cfg.model, cfg.revision), "feature_dtype": dtype_name(self.encoder.dtype),
                "preprocessing": cfg.preprocessing}


class FitSums(dict):
    """The statistics of a reference fit (``count``, ``sum``, ``outer``: :func:`gaussian.joint_sums` summed), and
    the samples left out of it under ``on_error="skip"`` (``skipped``: ``{index: reason}``)."""

    def __init__(self, sums: dict[str, Tensor], skipped: dict[int, str]) -> None:
        super().__init__(sums)
        self.skipped = dict(skipped)


def _reasons(skipped: dict[int, str], shown: int = 3) -> str:
    items = sorted(skipped.items())
    text = "; ".join(f"sample {i}: {reason}" for i, reason in items[:shown])
    return text + (f"; and {len(items) - shown} more" if len(items) > shown else "")


class ReferenceFit(Metric):
    """MID's reference Gaussian alone, as a metric a session streams: the sums of the (image, reference) pairs
    of each batch (``fit_pairs`` selects them). It shares its MID's configuration and encoder."""

    info = dataclasses.replace(MID.info, references="always")  # its errors name "mid", as scoring's do
    Config = MIDConfig

    def __init__(self, mid: MID) -> None:
        self.mid = mid
        self.config = mid.config

    def check_corpus(self, size: CorpusSize) -> FitProblem | None:
        return self.mid.fit_problem(size)

    def states(self) -> dict[str, StateSpec]:
        return {FIT[k]: s for k, s in sum_specs(2 * self.mid.dim).items()}

    def map(self, batch: Batch) -> dict[str, Tensor]:
        enc = self.mid.encoder
        texts, owner = self.mid.reference_pairs(batch.references)
        image_feats = enc.encode_images(batch.images)[batch.image_index.to(enc.device)]
        owner_t = torch.tensor(owner, device=image_feats.device)
        sums = gaussian.joint_sums(image_feats[owner_t], enc.encode_texts(texts))
        return {FIT[k]: v for k, v in sums.items()}

    def finalize(self, state: dict[str, Tensor]) -> MetricResult:
        raise NotImplementedError("a reference fit is folded (Session.fold), not finalized")


def load_fit(path: str) -> gaussian.SavedSums:
    """A reference Gaussian saved by :meth:`MID.fit_reference` (read here; parsed by the core)."""
    from capeval_plugins import files

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no saved reference Gaussian at {path}")
    return gaussian.sums_from_bytes(files.read_input(path, "saved reference Gaussian"), str(path))


def hub_commit(model: str, revision: str | None) -> str | None:
    """The cached commit of a hub id (the files of one commit are the same everywhere); None for a local path."""
    return None if os.path.exists(os.path.expanduser(model)) else cached_commit(model, revision or "main")


def configured_dtype(config: MIDConfig) -> torch.dtype:
    """The dtype the encoder will compute in, as its loader resolves it (float32 unless ``dtype`` is given)."""
    return loading.resolve_dtype(config.dtype, loading.resolve_device(config.device))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def feature_dim(config: Any) -> int:
    """Dimension of one CLIP feature (image and text share the joint space) from a model config."""
    dim = getattr(config, "projection_dim", None)
    return int(dim if dim else getattr(config, "text_config", config).hidden_size)


def sum_specs(dim: int) -> dict[str, StateSpec]:
    """States of :func:`gaussian.joint_sums` of pairs with ``dim`` joint dimensions."""
    return {"count": StateSpec("sum", torch.float64, ()), "sum": StateSpec("sum", torch.float64, (dim,)),
            "outer": StateSpec("sum", torch.float64, (dim, dim))}


METRICS = [MID]
