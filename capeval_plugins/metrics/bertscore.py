"""BERTScore (Zhang et al., ICLR 2020), as the ``bert_score`` package computes it.

P = mean over candidate tokens of the best cosine to a reference token, R the reverse, F = 2PR / (P + R),
optionally idf-weighted, on the contextual embeddings of one layer. Registered as ``bertscore`` (exposed to
Hugging Face ``evaluate`` only as ``capeval/bertscore``: the canonical ``bertscore`` module is never shadowed).

idf needs the references of the whole corpus, so the greedy matching runs per batch and the weighting at
finalize: ``map`` keeps, per sample and reference, each token's id and its best cosine (which do not depend
on the weights); ``finalize`` counts document frequencies over every reference of the corpus (or over
``idf_references``) and averages. The state is a few numbers per token and merges across batches and DDP
ranks like any ragged row.

bert_score's batched output (the default, ``matching="bert_score_batched"``) is also a finalize-time step: its
padding floor depends only on the pairs' order and its batch size, both known once the rows are in input order.
In a runner pass, ``prepare_corpus`` embeds each distinct text of the corpus once (longest first); ``map`` then
only gathers rows, and a streamed batch without that cache embeds its own texts.
"""
from __future__ import annotations

import csv
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import ClassVar, Collection, Sequence

import torch
from torch import Tensor

from capeval_plugins.contract import (INDEX, Batch, Metric, MetricInfo, MetricResult, ModelConfig, StateSpec, bounded,
                                      nanmean)
from capeval_plugins.models.encoders.common import EncoderSpec
from capeval_plugins.models.encoders.text import (PREFIX_SPACE, PackedEmbeddings, TextEncoder, TokenEmbeddings,
                                                text_encoder_problem)
from capeval_plugins.core.matching import (best_similarities, f_measure, idf_table, reduce_references, token_idf,
                                           weighted_mean)

CITATION = """@inproceedings{zhang2020bertscore,
  title     = {{BERTScore}: Evaluating Text Generation with {BERT}},
  author    = {Zhang, Tianyi and Kishore, Varsha and Wu, Felix and Weinberger, Kilian Q. and Artzi, Yoav},
  booktitle = {International Conference on Learning Representations},
  year      = {2020}
}"""


# bert_score's model per language (bert_score.utils.lang2model); any other language: multilingual BERT.
BERT_SCORE_LANG_MODELS = {"en": "roberta-large", "zh": "bert-base-chinese", "tr": "dbmdz/bert-base-turkish-cased",
                          "en-sci": "allenai/scibert_scivocab_uncased"}

# bert_score's default batch_size: its batched output (and so every published number) depends on it.
BERT_SCORE_BATCH_SIZE = 64


@dataclass
class BERTScoreConfig(ModelConfig):
    # bert_score's default English model (lang="en").
    model: str = "roberta-large"
    # None: bert_score's layer for known models (roberta-large: 17; microsoft/deberta-v3-large: 12), else the last.
    # 0 = the embeddings, k = block k, negative from the end (-1 = the last block); a layer the model lacks is
    # refused when it loads
    num_layers: int | None = bounded(None, ge=-4096, le=4096)
    idf: bool = False
    # Sentences to count idf over instead of the corpus's references (bert_score's idf dict; fixed weights).
    idf_references: Sequence[str] | None = None
    rescale_with_baseline: bool = False
    # A bert_score-format baseline file (CSV: LAYER,P,R,F); None: bert_score's English file for `model`.
    baseline_path: str | None = None
    # "max": bert_score's rule (P, R and F each the best over references); "mean": averaged over references.
    multi_reference: str = "max"
    # "bert_score_batched": bert_score's own (batched) output, which published numbers come from: pairs matched
    # in input order in batches of ``pair_batch_size`` pairs, where a padded position counts as cosine 0 (a token whose
    # cosines are all negative gets 0 when the other side of its pair is shorter than the longest in the batch).
    # "per_pair": each pair matched alone, independent of batching (bert_score run with batch_size=1).
    matching: str = "bert_score_batched"
    # Pairs per bert_score batch for "bert_score_batched": bert_score's ``batch_size``, 64 by default there. Kept
    # apart from ``batch_size`` (ours, a speed setting), so that changing how we batch never changes a score.
    pair_batch_size: int = bounded(BERT_SCORE_BATCH_SIZE, ge=1)
    # F where P and R have opposite signs (2PR / (P + R) is then no mean of P and R and explodes as P + R -> 0):
    # "keep" (bert_score's F, flagged) or "zero" (F = 0 there).
    opposite_sign: str = "keep"
    # GPT-2 and RoBERTa tokenizers: "paper" gives each text the leading space bert_score asks for (its authors' fix
    # to reproduce the paper's RoBERTa results; its baselines were made so); "as_saved" tokenises as the tokenizer
    # was saved, which is what bert_score 0.3.13 (and evaluate's bertscore) compute under transformers 5, where
    # its per-call request is ignored. Other tokenizers: the same tokens either way.
    prefix_space: str = "paper"
    input_paths: ClassVar[tuple[str, ...]] = ("model", "baseline_path")


class BERTScore(Metric):
    info = MetricInfo(
        name="bertscore",
        display_name="BERTScore",
        description=(
            "Greedy matching of contextual token embeddings between candidate and references: F1 of token-level "
            "best cosine similarities (precision and recall as extras), optional idf weighting and baseline "
            "rescaling; agrees with the bert_score package."
        ),
        citation=CITATION,
        references="always",
        images="never",
        score_range=None,
        paper="https://arxiv.org/abs/1904.09675",
        paper_config={"model": "roberta-large", "num_layers": 17, "idf": False, "multi_reference": "max"},
        codebase_urls=("https://github.com/Tiiiger/bert_score",),
    )
    Config = BERTScoreConfig
    score_aliases = ("f1",)
    model_kind_problem = staticmethod(text_encoder_problem)  # a --model shared by several metrics, checked unloaded

    def __init__(self, **config) -> None:
        super().__init__(**config)
        cfg = self.config
        if cfg.multi_reference not in ("max", "mean"):
            raise ValueError(f"bertscore: multi_reference must be 'max' or 'mean', got {cfg.multi_reference!r}")
        if cfg.matching not in MATCHING:
            raise ValueError(f"bertscore: matching must be one of {MATCHING}, got {cfg.matching!r}")
        if cfg.opposite_sign not in OPPOSITE_SIGN:
            raise ValueError(f"bertscore: opposite_sign must be one of {OPPOSITE_SIGN}, got {cfg.opposite_sign!r}")
        if cfg.prefix_space not in PREFIX_SPACE:
            raise ValueError(f"bertscore: prefix_space must be one of {PREFIX_SPACE}, got {cfg.prefix_space!r}")
        if cfg.idf_references is not None and not cfg.idf:
            raise ValueError("bertscore: idf_references is given but idf=False; set idf=True to use them")
        if cfg.baseline_path is not None and not cfg.rescale_with_baseline:
            raise ValueError("bertscore: baseline_path is given but rescale_with_baseline=False; set "
                             "rescale_with_baseline=True to use it")
        if cfg.idf_references is not None and (isinstance(cfg.idf_references, str) or not cfg.idf_references):
            raise ValueError("bertscore: idf_references must be a non-empty list of sentences")
        self._baseline: Tensor | None = None
        self._idf_table: tuple[Tensor, int] | None = None
        self._corpus: PackedEmbeddings | None = None

    @classmethod
    def reference_options(cls, options: dict, named: Collection[str] = ()) -> dict:
        """bert_score's argument names (what ``bert_score.score`` and evaluate's ``bertscore`` module take) as
        this metric's options: ``model_type`` is ``model``; ``lang`` picks bert_score's model for the language
        when no model is named (here or in ``named``, the options already set); ``batch_size`` is bert_score's pair batch (``pair_batch_size``: it changes the
        numbers); ``verbose``, ``nthreads`` and ``use_fast_tokenizer`` change no number and are dropped (the
        tokenizer is always the fast one, which gives these models' tokens); ``all_layers=True`` is refused."""
        out = dict(options)
        lang, model_type = out.pop("lang", None), out.pop("model_type", None)
        if model_type is not None:
            out["model"] = model_type
        elif lang is not None and "model" not in out and "model" not in named:
            out["model"] = BERT_SCORE_LANG_MODELS.get(str(lang).lower(), "bert-base-multilingual-cased")
        if lang is not None and str(lang).lower() != "en" and out.get("rescale_with_baseline"):
            if out.get("baseline_path") is None:
                raise ValueError(f"bertscore: rescaling for lang={lang!r} needs baseline_path (the bert_score baseline "
                                 f"file rescale_baseline/{lang}/<model>.tsv); only the English files are found by name")
        if "batch_size" in out:
            out["pair_batch_size"] = out.pop("batch_size")
        for ignored in ("verbose", "nthreads", "use_fast_tokenizer"):
            out.pop(ignored, None)
        if out.pop("all_layers", False):
            raise ValueError("bertscore: all_layers=True (a score per layer) is not supported; pick a layer with "
                             "num_layers")
        return out

    @property
    def encoder(self) -> TextEncoder:
        return TextEncoder.shared(EncoderSpec.from_config(self.config), self.config.num_layers, self.config.prefix_space)

    @property
    def pair_batch_size(self) -> int:
        return self.config.pair_batch_size

    def prepare_corpus(self, corpus: Batch) -> None:
        """Embed each distinct text of the whole pass once, longest first (as bert_score does), and normalise
        it once; ``map`` then only gathers. A batch with a text outside this set (e.g. an adapter's update)
        embeds its own texts."""
        refs = [r for sample_refs in corpus.references or () for r in sample_refs]
        texts = [*corpus.candidates, *refs]
        self._corpus = self.encoder.embed_packed(texts, batch_size=self.config.batch_size).unit() if texts else None

    def release_corpus(self) -> None:
        self._corpus = None

    def unit_embeddings(self, candidates: list[str], pair_candidates: list[str],
                        refs: list[str]) -> tuple[TokenEmbeddings, TokenEmbeddings, TokenEmbeddings]:
        """Unit-norm token embeddings of the candidates, of each pair's candidate (same width) and of each
        reference: gathered from the corpus cache, or from one model pass over the batch's distinct texts (the
        candidates of one image share their references)."""
        corpus = self._corpus
        if corpus is not None and corpus.covers(candidates) and corpus.covers(refs):
            cand = corpus.gather(candidates)
            return cand, corpus.gather(pair_candidates, width=cand.embeddings.shape[1]), corpus.gather(refs)
        texts = list(dict.fromkeys([*candidates, *refs]))
        row = {t: i for i, t in enumerate(texts)}
        emb = self.encoder.embed(texts, batch_size=self.config.batch_size).unit()
        return tuple(emb.rows(torch.tensor([row[t] for t in group])) for group in (candidates, pair_candidates, refs))

    def states(self) -> dict[str, StateSpec]:
        return {
            # token ids + 1 (0 marks padding); per reference, each token's best cosine on the other side
            "cand_ids": StateSpec("cat", torch.int64, (-1,)),
            "cand_best": StateSpec("cat", torch.float64, (-1, -1)),
            "ref_ids": StateSpec("cat", torch.int64, (-1, -1)),
            "ref_best": StateSpec("cat", torch.float64, (-1, -1)),
        }

    def map(self, batch: Batch) -> dict[str, Tensor]:
        n = len(batch)
        owner, slot, refs = [], [], []
        for i, sample_refs in enumerate(batch.references or ()):
            owner += [i] * len(sample_refs)
            slot += list(range(len(sample_refs)))
            refs += sample_refs
        cand, pairs, ref = self.unit_embeddings(batch.candidates, [batch.candidates[i] for i in owner], refs)
        owner_t, slot_t = torch.tensor(owner), torch.tensor(slot)
        # bert_score matches against every token, [CLS] and [SEP] included (they only get no weight).
        cand_best, ref_best = best_similarities(pairs.embeddings, pairs.attention_mask, ref.embeddings,
                                                ref.attention_mask, normalized=True)
        width = int(slot_t.max()) + 1
        return {
            "cand_ids": shifted_ids(cand.input_ids, cand.attention_mask).cpu(),
            "cand_best": scatter_rows(cand_best, pairs.attention_mask, owner_t, slot_t, n, width),
            "ref_ids": scatter_rows(shifted_ids(ref.input_ids, ref.attention_mask), None, owner_t, slot_t, n, width),
            "ref_best": scatter_rows(ref_best, ref.attention_mask, owner_t, slot_t, n, width),
        }

    def finalize(self, state: dict[str, Tensor]) -> MetricResult:
        cand_ids, ref_ids = state["cand_ids"], state["ref_ids"]
        valid_ref = (ref_ids > 0).any(dim=-1)
        cand_w, ref_w = self.token_weights(cand_ids, ref_ids, valid_ref)
        cand_best, ref_best = state["cand_best"], state["ref_best"]
        if self.config.matching == "bert_score_batched":
            cand_best, ref_best = bert_score_padding_floor(cand_best, ref_best, (cand_ids > 0).sum(-1),
                                                           (ref_ids > 0).sum(-1), valid_ref, self.pair_batch_size)
        precision = weighted_mean(cand_best, cand_w[:, None, :].expand_as(cand_best))
        recall = weighted_mean(ref_best, ref_w)
        # bert_score sets P and R to 0 where either side is only special tokens (an empty caption): F is then 0
        blank = self.only_special(cand_ids)[:, None] | self.only_special(ref_ids)
        precision, recall = precision.masked_fill(blank, 0.0), recall.masked_fill(blank, 0.0)
        f1 = f_measure(precision, recall)
        opposite = (precision * recall < 0) & valid_ref
        if self.config.opposite_sign == "zero":
            f1 = torch.where(opposite, torch.zeros_like(f1), f1)
        flagged = opposite.sum(-1).to(torch.float64)
        warn_opposite_signs(int((flagged > 0).sum()), self.config.opposite_sign)
        how = self.config.multi_reference
        prf = torch.stack([reduce_references(x, valid_ref, how) for x in (precision, recall, f1)], dim=-1)
        if self.config.rescale_with_baseline:
            baseline = self.baseline().to(prf.device)
            prf = (prf - baseline) / (1 - baseline)
        p, r, f = prf.unbind(-1)
        return MetricResult(
            name=self.info.name,
            score=nanmean(f),
            scores=f,
            indices=state[INDEX],
            extras={"precision": p, "recall": r, "f1": f.clone(), "opposite_sign_refs": flagged},
            corpus_extras={"mean_precision": nanmean(p), "mean_recall": nanmean(r),
                           "n_opposite_sign": float((flagged > 0).sum())},
        )

    # --- weights -------------------------------------------------------------------------------------------
    def token_weights(self, cand_ids: Tensor, ref_ids: Tensor, valid_ref: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token weights (0 on padding): idf, or 1 with [CLS]/[SEP] at 0 (bert_score's two cases)."""
        if self.config.idf:
            table, n_docs = self.idf_table(ref_ids[valid_ref])
            return tuple(token_idf(ids - 1, ids > 0, table, n_docs) for ids in (cand_ids, ref_ids))
        special = torch.tensor(sorted(self.encoder.special_ids), dtype=torch.int64, device=cand_ids.device)
        return tuple(((ids > 0) & ~torch.isin(ids - 1, special)).to(torch.float64) for ids in (cand_ids, ref_ids))

    def only_special(self, ids: Tensor) -> Tensor:
        """Rows (of shifted ids, 0 = padding) holding no token but [CLS] / [SEP]: an empty text."""
        special = torch.tensor(sorted(self.encoder.special_ids), dtype=torch.int64, device=ids.device)
        return ~((ids > 0) & ~torch.isin(ids - 1, special)).any(dim=-1)

    def idf_table(self, corpus_refs: Tensor) -> tuple[Tensor, int]:
        """idf per token id (indexed by id) and the number of documents it was counted over."""
        if self.config.idf_references is None:
            return idf_table(corpus_refs - 1, pad_id=-1)
        if self._idf_table is None:
            ids = self.encoder.tokenize(list(self.config.idf_references))
            docs = torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in ids], batch_first=True, padding_value=-1)
            self._idf_table = idf_table(docs, pad_id=-1)
        return self._idf_table

    # --- baseline ------------------------------------------------------------------------------------------
    def baseline(self) -> Tensor:
        """(P, R, F) baselines of the layer in use, from ``baseline_path`` or bert_score's English file."""
        if self._baseline is None:
            path = self.config.baseline_path or bundled_baseline(self.config.model)
            self._baseline = read_baseline(path, self.encoder.layer)
        return self._baseline


MATCHING = ("bert_score_batched", "per_pair")
OPPOSITE_SIGN = ("keep", "zero")


def bert_score_padding_floor(cand_best: Tensor, ref_best: Tensor, cand_len: Tensor, ref_len: Tensor,
                             valid_ref: Tensor, batch_size: int) -> tuple[Tensor, Tensor]:
    """bert_score's batched output from per-pair best cosines: it flattens the (candidate, reference) pairs in
    input order, matches them ``batch_size`` at a time with both sides padded to the longest of the batch, and
    multiplies the similarities by the padding mask, so padding competes as cosine 0. A candidate token's best
    is thus floored at 0 when its reference is shorter than the batch's longest reference, a reference token's
    when its candidate is shorter than the batch's longest candidate. Shapes: bests (N, J, L), ``cand_len``
    (N,), ``ref_len`` and ``valid_ref`` (N, J), rows in input order."""
    valid = valid_ref.reshape(-1)
    batch = (torch.cumsum(valid.long(), 0) - 1).div(batch_size, rounding_mode="floor").clamp_min(0)
    pair_cand_len = cand_len[:, None].expand_as(valid_ref).reshape(-1)
    pair_ref_len = ref_len.reshape(-1)
    n_batches = int(batch.max()) + 1 if len(batch) else 0

    def longest(lengths: Tensor) -> Tensor:
        top = torch.zeros(n_batches, dtype=lengths.dtype, device=lengths.device)
        return top.scatter_reduce(0, batch[valid], lengths[valid], reduce="amax")[batch]

    ref_short = ((pair_ref_len < longest(pair_ref_len)) & valid).reshape(valid_ref.shape)
    cand_short = ((pair_cand_len < longest(pair_cand_len)) & valid).reshape(valid_ref.shape)
    cand_best = torch.where(ref_short[..., None], cand_best.clamp_min(0), cand_best)
    ref_best = torch.where(cand_short[..., None], ref_best.clamp_min(0), ref_best)
    return cand_best, ref_best


def warn_opposite_signs(count: int, policy: str) -> None:
    if not count:
        return
    what = "F is set to 0 there (opposite_sign='zero')" if policy == "zero" else (
        "F = 2PR/(P+R) is then not a mean of P and R and can lie far outside [min(P, R), max(P, R)]; "
        "opposite_sign='zero' sets it to 0")
    warnings.warn(f"bertscore: {count} sample(s) have a reference where precision and recall have opposite signs "
                  f"(extra 'opposite_sign_refs' counts them per sample); {what}", stacklevel=3)


def shifted_ids(ids: Tensor, mask: Tensor) -> Tensor:
    """Token ids + 1 with 0 on padding, so zero-padding added when states merge reads as padding."""
    return torch.where(mask, ids + 1, torch.zeros_like(ids))


def scatter_rows(values: Tensor, mask: Tensor | None, owner: Tensor, slot: Tensor, n: int, width: int) -> Tensor:
    """Per-pair rows (R, L) into a (n, width, L) grid by sample and reference slot, zero elsewhere."""
    values = values if mask is None else values.masked_fill(~mask, 0)
    grid = torch.zeros((n, width, values.shape[-1]), dtype=values.dtype, device=values.device)
    grid[owner.to(values.device), slot.to(values.device)] = values
    return grid.cpu()


def bundled_baseline(model: str) -> str:
    """bert_score's rescaling baseline for ``model`` (English), if bert_score is installed and has one."""
    spec = importlib.util.find_spec("bert_score")
    path = None
    if spec is not None and spec.origin:
        path = os.path.join(os.path.dirname(spec.origin), "rescale_baseline", "en", f"{model}.tsv")
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            f"bertscore: no rescaling baseline for {model!r}: pass baseline_path (a CSV with columns LAYER,P,R,F); "
            "bert_score ships English baselines for some models (not for microsoft/deberta-v3-large)"
        )
    return path


def read_baseline(path: str, layer: int) -> Tensor:
    """The (P, R, F) row of ``layer`` in a bert_score baseline file (CSV with header LAYER,P,R,F)."""
    with open(path, newline="") as handle:
        for record in csv.DictReader(handle):
            if int(float(record["LAYER"])) == layer:
                return torch.tensor([float(record[k]) for k in ("P", "R", "F")], dtype=torch.float64)
    raise ValueError(f"bertscore: baseline file {path} has no row for layer {layer}")


METRICS = [BERTScore]
