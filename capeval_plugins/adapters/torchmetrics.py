"""torchmetrics adapter, generic over the contract.

``capeval_plugins.torchmetrics.<Class>`` exists for every registered metric (``CLIPScore``, ...). States
come from the contract: ``"sum"`` statistics and ``"cat"`` rows, plus the sample ids and group ids every
metric carries, so under DDP the repeats a ``DistributedSampler`` adds are dropped and input order is
restored (pass ``ids=`` with dataset indices). Ids repeated beyond what a padding sampler adds
(``world_size - 1``), or one id given for two different samples, are an error naming them, never silently
dropped samples. ``compute()`` returns the corpus score as a scalar tensor (Lightning's ``self.log(name,
metric)`` works); ``compute_all()`` returns the full :class:`~capeval_plugins.contract.MetricResult` with
per-sample scores and extras, and ``last_result`` keeps the latest one through ``reset()`` (Lightning resets a
logged metric as soon as it has computed it). The backbone is not part of the module tree (not in
``state_dict``, not copied by ``clone()``) and is shared between instances.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torchmetrics

from capeval_plugins import preflight, registry, runner
from capeval_plugins.adapters.naming import GeneratedClasses, identifier
from capeval_plugins.contract import (TEXT_STATE, Metric, MetricResult, PackedTexts, StateSpec, decode_texts,
                                      encode_texts, full_spec)
from capeval_plugins.core.messages import warn_once

# torchmetrics.Metric keyword arguments; everything else is a metric option.
TORCHMETRICS_ARGS = frozenset(
    "compute_on_cpu dist_sync_on_step process_group dist_sync_fn distributed_available_fn sync_on_compute "
    "compute_with_cache".split()
)
# Samples skipped under on_error="skip": their ids and reasons, synced like any "cat" state.
SKIPPED_SPEC = {"_skipped_index": StateSpec("cat", torch.int64), "_skipped_reason": TEXT_STATE}


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class CapevalMetric(torchmetrics.Metric):
    """A registered capeval metric as a torchmetrics ``Metric``."""

    full_state_update = False
    is_differentiable = False
    higher_is_better: bool | None = True
    _capeval_name: str = ""

    def __init__(self, metric: Metric | None = None, **kwargs: Any) -> None:
        tm_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in TORCHMETRICS_ARGS}
        super().__init__(**tm_kwargs)
        if metric is not None and kwargs:
            raise TypeError("pass either a built metric or its options, not both")
        self.capeval_metric = metric if metric is not None else registry.load(self._capeval_name, **kwargs)
        preflight.check({self.capeval_metric.info.name: self.capeval_metric})  # before the first batch is generated
        self._spec = {**full_spec(self.capeval_metric), **SKIPPED_SPEC}
        for name, spec in self._spec.items():
            if spec.reduce == "cat":
                # ragged rows are gathered per rank and padded to the widest in _merged_state
                self.add_state(name, default=[], dist_reduce_fx=None if spec.ragged else "cat")
            else:
                self.add_state(name, default=spec.empty(), dist_reduce_fx="sum")
        self._seen = 0
        self._ids: set[int] = set()  # ids updated on this rank: a repeat here is a user error
        self._guessed_ids = False  # ids made up under DDP: per-sample rows cannot be trusted
        self._result: MetricResult | None = None
        # The full result of the latest compute(), kept through reset(): Lightning computes a logged metric at
        # the end of an epoch and resets it at once, so this is how the epoch's per-sample scores get out.
        self.last_result: MetricResult | None = None
        self._last_guessed = False

    def update(
        self,
        images: Sequence[Any] | None = None,
        captions: Sequence[str] | None = None,
        references: Sequence[Any] | None = None,
        *,
        ids: Sequence[int] | torch.Tensor | None = None,
        group_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        """Score one batch. ``ids`` are global sample ids (e.g. dataset indices): errors name them, repeats are
        dropped and order restored at ``compute``. Without them, ids follow the interleaving of a non-shuffled
        ``DistributedSampler`` (``rank + world_size * position``), and the repeats it adds are counted."""
        metric = self.capeval_metric
        n = len(captions) if captions is not None and not isinstance(captions, str) else 0
        if ids is None:
            rank, world = _world()
            if world > 1:
                warn_once(("torchmetrics-ids", metric.info.name), (
                    f"{metric.info.name}: update() without ids under {world} processes: the samples a "
                    "DistributedSampler repeats to even out the shards cannot be dropped and are counted "
                    "twice; pass ids=<dataset indices of the batch> (e.g. from the dataset's __getitem__)"))
            ids = [rank + world * (self._seen + i) for i in range(n)]
            self._guessed_ids = self._guessed_ids or world > 1
        corpus = runner.Corpus(captions, images, references, group_ids, ids)
        samples, skipped = runner.validate(metric, corpus)
        self._check_new_ids(corpus.ids)
        self._seen += n
        self._skip(skipped)
        cache, how = runner.image_cache([metric]), runner.policy(metric)
        for part in runner.iter_parts(metric, samples):
            outs, dropped = runner.map_part(metric, part, cache, how)  # a sample failing here: per the policy
            self._skip(dropped)
            for out in outs:
                for name, value in out.items():
                    # torchmetrics moves and casts list states element-wise: tensors only (packed texts padded)
                    value = (value.padded() if isinstance(value, PackedTexts) else value).to(self.device)
                    if self._spec[name].reduce == "cat":
                        getattr(self, name).append(value)
                    else:
                        setattr(self, name, getattr(self, name) + value)

    def _check_new_ids(self, ids: Sequence[int] | torch.Tensor) -> None:
        """A sample id given again on this rank (in an earlier update) would drop a sample: refuse it. Repeats
        across ranks are what a padding DistributedSampler adds; compute() drops and counts those."""
        from capeval_plugins.inputs import InputError, repeated_ids

        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        repeated = repeated_ids(ids, self._ids)
        if repeated:
            shown = ", ".join(str(i) for i in repeated[:10]) + (f" and {len(repeated) - 10} more" if len(repeated) > 10 else "")
            raise InputError(f"{self.capeval_metric.info.name}: sample id(s) {shown} already given in an earlier "
                             "update() since the last reset(): ids must be unique per process")
        self._ids.update(ids)

    def _skip(self, skipped: dict[int, str]) -> None:
        if skipped:
            self._skipped_index.append(torch.tensor(list(skipped), dtype=torch.int64, device=self.device))
            self._skipped_reason.append(encode_texts(list(skipped.values())).to(self.device))

    def _merged_state(self) -> dict[str, torch.Tensor]:
        state = {}
        for name, spec in self._spec.items():
            value = getattr(self, name)
            if spec.reduce == "cat":
                value = spec.cat(value if isinstance(value, list) else [value]).to(self.device)
            state[name] = value
        return state

    def compute(self) -> torch.Tensor:
        state = self._merged_state()
        skipped = dict(zip(state.pop("_skipped_index").tolist(), decode_texts(state.pop("_skipped_reason"))))
        # a padding DistributedSampler repeats at most world_size - 1 samples, each the same sample: more (ids
        # that are positions in a shard, not dataset indices) or another sample under one id is an error
        self._result = self.last_result = runner.finalize(self.capeval_metric, state, skipped,
                                                          allowed_repeats=_world()[1] - 1)
        self._last_guessed = self._guessed_ids
        return torch.tensor(self._result.score, dtype=torch.float64, device=self.device)

    def compute_all(self) -> MetricResult:
        """Corpus score, per-sample scores (in sample-id order, repeats dropped) and extras.

        With nothing updated since the last ``reset()`` (after ``Trainer.validate``, which computes a logged
        metric at the end of the epoch and resets it), the result of that last computation
        (:attr:`last_result`): the epoch's per-sample scores.

        Under DDP the per-sample rows are filed by the ids given to ``update``; without ids they would follow
        a guess (a non-shuffled sampler's interleaving), wrong for a shuffled one, so they are refused: pass
        ``ids=`` (``compute()``'s corpus score does not depend on them)."""
        kept = self._update_count == 0 and self.last_result is not None
        if self._last_guessed if kept else self._guessed_ids:
            raise ValueError(
                f"{self.capeval_metric.info.name}: per-sample results under torch.distributed need ids=<dataset "
                "indices> in every update(): without them a shuffled sampler's samples are filed under wrong "
                "indices; compute() gives the corpus score")
        if kept:
            return self.last_result
        self.compute()
        assert self._result is not None
        return self._result

    def reset(self) -> None:
        super().reset()
        self._seen = 0
        self._ids = set()
        self._guessed_ids = False
        self._result = None

    def _sync_dist(self, dist_sync_fn=None, process_group=None) -> None:
        # Every rank sends exactly one tensor per "cat" state, of the state's true dtype and trailing shape:
        # torchmetrics' placeholder for a rank with no samples is a 1-D float32 tensor (the gather then
        # fails), and it does not pre-concatenate ragged states, whose per-batch lists differ in length
        # between ranks (one collective per list item would then deadlock).
        for name, spec in self._spec.items():
            value = getattr(self, name)
            if spec.reduce == "cat" and isinstance(value, list) and (not value or spec.ragged):
                setattr(self, name, [spec.cat_padded(value).to(self.device)])  # a tensor to gather
        kwargs = {"process_group": process_group}
        if dist_sync_fn is not None:
            kwargs["dist_sync_fn"] = dist_sync_fn
        super()._sync_dist(**kwargs)


metric_class = GeneratedClasses(
    CapevalMetric, "capeval_plugins.torchmetrics", identifier,
    lambda info: {"higher_is_better": info.higher_is_better},
)
