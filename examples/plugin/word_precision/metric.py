"""WordPrecision: the share of a caption's words found in its references; the corpus score pools every word."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from capeval_plugins.contract import INDEX, Batch, Metric, MetricConfig, MetricInfo, MetricResult, StateSpec


@dataclass
class WordPrecisionConfig(MetricConfig):
    lowercase: bool = True  # the "paper's" reading; False compares words as written


class WordPrecision(Metric):
    info = MetricInfo(
        name="word_precision",
        display_name="WordPrecision",
        description="Share of the caption's words found in its references; the corpus score pools every word.",
        citation="@misc{word_precision, title = {Word precision, an example metric}}",
        references="always",
        images="never",
        score_range=(0.0, 1.0),
        paper_config={"lowercase": True},
    )
    Config = WordPrecisionConfig
    card = str(Path(__file__).with_name("README.md"))

    @classmethod
    def tiny_recipe(cls):
        return {}  # no model to build: the defaults run anywhere in milliseconds

    def states(self):
        return {"precision": StateSpec("cat", torch.float64),  # one row per sample
                "words": StateSpec("sum", torch.float64, (2,))}  # (found, total) over the corpus

    def map(self, batch: Batch):
        fold = str.lower if self.config.lowercase else str
        found, total = [], []
        for caption, references in zip(batch.candidates, batch.references):
            known = {word for reference in references for word in fold(reference).split()}
            words = fold(caption).split()
            found.append(sum(word in known for word in words))
            total.append(len(words))
        found, total = torch.tensor(found, dtype=torch.float64), torch.tensor(total, dtype=torch.float64)
        precision = torch.where(total > 0, found / total.clamp(min=1), 0.0)  # an empty caption finds nothing
        return {"precision": precision, "words": torch.stack([found.sum(), total.sum()])}

    def finalize(self, state):
        found, total = state["words"].tolist()
        return MetricResult(self.info.name, found / total if total else 0.0, state["precision"], state[INDEX],
                            corpus_extras={"words": total})
