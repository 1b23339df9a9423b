"""torchmetrics adapter, generic over the contract.

``capeval_plugins.torchmetrics.<Class>`` exists for every registered metric (``CLIPScore``, ...). It scores
through a :class:`~capeval_plugins.session.Session`, as every entry point does: the metric's paths and
requirements are checked when it is built, each ``update()`` batch is validated (errors name the ids) and is
one pass of the session's loop, ``compute()`` checks the corpus it accumulated (``check_corpus``: MID's fit
needs more pairs than dimensions; the same error as ``capeval_plugins.load("mid")(...)``) and finalizes. States
come from the contract: ``"sum"`` statistics and ``"cat"`` rows, plus the sample ids and group ids every metric
carries, so under DDP the repeats a ``DistributedSampler`` adds are dropped and input order is restored (pass
``ids=`` with dataset indices). Every merge is :func:`~capeval_plugins.contract.merge_states`: an update's
batches, the running sums over updates, and the ranks (each state gathered per rank as it is, in rank order;
torchmetrics' own reductions are not used: :class:`RankMerge`). Ids repeated beyond what a padding sampler adds (``world_size - 1``), or one id given
for two different samples, are an error naming them, never silently dropped samples.

``compute()`` returns the corpus score as a scalar tensor (Lightning's ``self.log(name, metric)`` works);
``metric(batch)`` (``forward``) adds the batch as ``update()`` does and returns the batch's own score;
``compute_all()`` returns the full :class:`~capeval_plugins.contract.MetricResult` with per-sample scores and
extras, and ``last_result`` keeps the latest one through ``reset()`` (Lightning resets a logged metric as soon
as it has computed it); ``plot()`` draws values as torchmetrics' own metrics do, within the metric's score
range. The backbone is not part of the module tree (not in ``state_dict``, not copied by ``clone()``) and is
shared between instances. Where this touches torchmetrics' internals is :mod:`.torchmetrics_internals`.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import torch

from capeval_plugins import registry, runner
from capeval_plugins.adapters.naming import GeneratedClasses, identifier
from capeval_plugins.contract import (INDEX, TEXT_STATE, Metric, MetricInfo, MetricResult, PackedTexts, StateSpec,
                                      decode_texts, encode_texts, merge_states)
from capeval_plugins.core.arrays import as_tensor
from capeval_plugins.core.messages import require, warn_once

# the ecosystem this adapter plugs into: without it, one line naming the extra that installs it
torchmetrics = require("torchmetrics", "torchmetrics", "capeval_plugins.torchmetrics")
from capeval_plugins.adapters import torchmetrics_internals as internals  # noqa: E402  (imports torchmetrics)

# torchmetrics.Metric keyword arguments; everything else is a metric option.
TORCHMETRICS_ARGS = frozenset(
    "compute_on_cpu dist_sync_on_step process_group dist_sync_fn distributed_available_fn sync_on_compute "
    "compute_with_cache".split()
)
internals.check()  # torchmetrics' internals used here are where they were on the versions checked

# Samples skipped under on_error="skip": their ids and reasons, synced like any "cat" state.
SKIPPED_SPEC = {"_skipped_index": StateSpec("cat", torch.int64), "_skipped_reason": TEXT_STATE}
# One row per update(): 1 where its ids were made up in one process (positions in the order given). When every
# update's were, compute() numbers the samples afresh in that order, so that states kept apart and merged later
# (torchmetrics' Running keeps one per update of its window; merge_state moves another instance's past these)
# do not collide.
MADE_UP_SPEC = {"_made_up_ids": StateSpec("cat", torch.int64)}
SAMPLE_ID_STATES = (INDEX, "_skipped_index", "_size_index")


class RankMerge:
    """The reduction torchmetrics applies to a ``"sum"`` state's values gathered from every rank (stacked in rank
    order; or, in its wrappers' ``_reduce_states``, a kept state and a new one): the contract's one reduce,
    :func:`~capeval_plugins.contract.merge_states`, in that order. A class, not a closure: a metric pickles."""

    def __init__(self, name: str, spec: StateSpec) -> None:
        self.name, self.spec = name, spec

    def __call__(self, stacked: torch.Tensor) -> torch.Tensor:
        return merge_states({self.name: self.spec}, ({self.name: row} for row in stacked))[self.name]


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
        self._name = self.capeval_metric.info.name
        whole_corpus = self.capeval_metric.whole_corpus_only()
        if whole_corpus:  # each update would be prepared as a corpus of its own: other scores, silently
            raise ValueError(whole_corpus)
        # paths and requirements (models, Java, extras): checked before the first batch is generated
        self._session = runner.Session({self._name: self.capeval_metric})
        self._own_spec = {**self._session.spec(self._name), **SKIPPED_SPEC, **MADE_UP_SPEC}
        if runner.checks_corpus(self.capeval_metric):  # what compute() needs to check the streamed corpus
            self._own_spec.update(runner.SIZE_SPEC)
        # torchmetrics holds, moves and syncs tensors: a host state (numpy: texts, the classic metrics' states)
        # is held as the tensor of its rows, and handed back to finalize as its own kind (StateSpec.own_kind)
        self._spec = {name: spec.on_torch() for name, spec in self._own_spec.items()}
        # merged with text states packed (each update's padded block packed: one long caption costs its own bytes)
        self._merge_spec = {name: own if own.text else self._spec[name] for name, own in self._own_spec.items()}
        # Every rank's states are gathered as they are (rows: one tensor per rank, see _sync_dist; sums: stacked)
        # and merged by the contract's one reduce, in rank order: merge_states at compute() for rows,
        # RankMerge for sums. torchmetrics' own "cat" / "sum" reductions are not used.
        for name, spec in self._spec.items():
            if spec.reduce == "cat":
                self.add_state(name, default=[], dist_reduce_fx=None)
            else:
                self.add_state(name, default=spec.empty(), dist_reduce_fx=RankMerge(name, spec))
        self._seen = 0
        self._positions = 0  # made-up ids in one process: never reset, so that no two updates share one
        self._ids: set[int] = set()  # ids updated on this rank: a repeat here is a user error
        self._guessed_ids = False  # ids made up under DDP: per-sample rows cannot be trusted
        self._last_batch: list[dict[str, torch.Tensor]] = []  # what the latest update() added, for forward
        self._result: MetricResult | None = None
        # The full result of the latest compute(), kept through reset(): Lightning computes a logged metric at
        # the end of an epoch and resets it at once, so this is how the epoch's per-sample scores get out.
        self.last_result: MetricResult | None = None
        self._last_guessed = False

    # -- update / forward ------------------------------------------------------------------------------------

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
        dropped and order restored at ``compute``. Without them, in one process a sample's id is its position in
        the order given (numbered afresh at ``compute``, so that states merged later, as a ``Running`` window's, do
        not collide); under DDP ids follow the interleaving of a non-shuffled ``DistributedSampler``
        (``rank + world_size * position``), and the repeats it adds are counted."""
        n = len(captions) if captions is not None and not isinstance(captions, str) else 0
        rank, world = _world()
        made_up = ids is None
        if made_up:
            if world > 1:
                warn_once(("torchmetrics-ids", self._name), (
                    f"{self._name}: update() without ids under {world} processes: the samples a "
                    "DistributedSampler repeats to even out the shards cannot be dropped and are counted "
                    "twice; pass ids=<dataset indices of the batch> (e.g. from the dataset's __getitem__)"))
                ids = [rank + world * (self._seen + i) for i in range(n)]
            else:
                ids = [self._positions + i for i in range(n)]
        guessed = made_up and world == 1
        corpus = runner.Corpus(captions, images, references, group_ids, ids)
        samples, skipped = self._session.validate(corpus)[self._name]
        if made_up:
            self._refuse_made_up_seeds(samples.group_ids)
        new_ids = self._refuse_repeated_ids(corpus.ids)
        # the session's pass over this batch (in the metric's batches; a sample failing: per the policy)
        plan = self._session.plan(self._name, samples, skipped)
        self._session.run([plan])
        # Only a batch that scored is counted: an update() that raises leaves the metric as it was, so the same
        # ids can be given again once the input is fixed.
        self._ids.update(new_ids)
        self._seen += n
        self._positions += n if guessed else 0
        self._guessed_ids = self._guessed_ids or (made_up and world > 1)
        added = [{"_made_up_ids": torch.tensor([int(guessed)], dtype=torch.int64)}, self._skipped_rows(plan.skipped)]
        if runner.SIZE_SPEC.keys() <= self._spec.keys():
            added.append(runner.size_rows(samples))
        added += [*plan.progress.rows, plan.progress.sums or {}, self._skipped_rows(plan.progress.skipped)]
        self._last_batch = [a for a in added if a]
        for block in self._last_batch:
            self._add(block)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``metric(batch)``: add the batch to the accumulated state exactly as ``update()`` does (its ids, or
        the ids ``update()`` would guess, continue those of earlier batches) and return the batch's own corpus
        score, computed from the batch alone (synced over processes only with ``dist_sync_on_step=True``). A
        corpus metric that cannot be fitted on one batch (MID on a few samples) gives NaN here, with a warning;
        its ``compute()`` over the accumulated corpus is the number."""
        internals.refuse_forward_when_synced(self)
        self.update(*args, **kwargs)
        state = self._merged_state(self._last_batch)
        if self.dist_sync_on_step and _world()[1] > 1:
            # every rank's batch in rank order, merged over every state this adapter keeps (the skipped samples and
            # the made-up-ids flags are its own: the session's spec does not declare them)
            state = self._merged_state(runner.gather(state, _world()[1], None))
        value = self._value(state, keep=False)
        internals.set_forward_cache(self, value)
        return value

    def _refuse_repeated_ids(self, ids: Sequence[int] | torch.Tensor) -> list[int]:
        """``ids`` as ints, refused when one was given again on this rank (in an earlier update): it would drop a
        sample. Repeats across ranks are what a padding DistributedSampler adds; compute() drops and counts those.
        The caller records them once its batch is scored."""
        from capeval_plugins.inputs import InputError, repeated_ids

        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        repeated = repeated_ids(ids, self._ids)
        if repeated:
            raise InputError(f"{self._name}: sample id(s) {_shown(repeated)} already given in an earlier "
                             "update() since the last reset(): ids must be unique per process")
        return ids

    def merge_state(self, incoming_state: dict[str, Any] | torchmetrics.Metric) -> None:
        """torchmetrics' ``merge_state``: this metric's samples, then those of ``incoming_state`` (a metric of this
        class, or its ``metric_state``). Ids made up in one process are positions, from 0 in every instance: when
        both sides' are, the incoming ones are moved past this metric's, so no two samples share one. An id on
        both sides is an error naming it (given twice, it would drop a sample)."""
        if isinstance(incoming_state, type(self)):
            incoming = {name: getattr(incoming_state, name) for name in self._spec}
        elif isinstance(incoming_state, dict) and self._spec.keys() <= incoming_state.keys():
            incoming = dict(incoming_state)
        else:  # not a state of this metric: torchmetrics' own error
            return super().merge_state(incoming_state)
        both_made_up = _all_ones(incoming["_made_up_ids"], empty=False) and _all_ones(self._made_up_ids, empty=True)
        if both_made_up:
            incoming.update({key: _shifted(incoming[key], self._positions) for key in SAMPLE_ID_STATES
                             if key in self._spec})
        theirs = _sample_ids(incoming)
        repeated = sorted(_sample_ids({name: getattr(self, name) for name in self._spec}) & theirs)
        if repeated:
            from capeval_plugins.inputs import InputError

            raise InputError(f"{self._name}: merge_state(): sample id(s) {_shown(repeated)} are in both states: "
                             "ids must be unique across the states merged (pass each sample's dataset index)")
        if hasattr(torchmetrics.Metric, "merge_state"):
            super().merge_state(incoming)
        else:  # torchmetrics before 1.5 has none: rows after rows, sums by the one reduce
            for name, spec in self._spec.items():
                value = incoming[name]
                if spec.reduce == "cat":
                    setattr(self, name, [*getattr(self, name), *(value if isinstance(value, list) else [value])])
                else:
                    setattr(self, name, merge_states({name: spec}, [{name: getattr(self, name)}, {name: value}])[name])
        internals.forget_computed(self)  # compute() kept the value of the state before the merge
        self._ids.update(theirs)  # a later update() giving one of them again is refused as on this rank
        if both_made_up:  # this metric's next made-up ids follow the merged ones
            self._positions = max([self._positions, *(i + 1 for i in theirs)])
        self._guessed_ids = self._guessed_ids or getattr(incoming_state, "_guessed_ids", False)

    @staticmethod
    def _skipped_rows(skipped: dict[int, str]) -> dict[str, torch.Tensor]:
        if not skipped:
            return {}
        return {"_skipped_index": torch.tensor(list(skipped), dtype=torch.int64),
                "_skipped_reason": encode_texts(list(skipped.values()))}

    def _add(self, block: dict[str, Any]) -> None:
        for name, value in block.items():
            # torchmetrics moves and casts list states element-wise: tensors only (packed texts padded)
            value = as_tensor(value.padded() if isinstance(value, PackedTexts) else value).to(self.device)
            if self._spec[name].reduce == "cat":  # a new list: members of a MetricCollection's compute group
                setattr(self, name, [*getattr(self, name), value])  # share the old one (torchmetrics does this too)
            else:  # the running sum, by the one reduce
                kept = getattr(self, name)
                setattr(self, name, merge_states({name: self._spec[name]}, [{name: kept}, {name: value.to(kept.dtype)}])[name])

    # -- compute ---------------------------------------------------------------------------------------------

    def _merged_state(self, blocks: Sequence[dict[str, Any]] | None = None) -> dict[str, torch.Tensor]:
        """The merged state of ``blocks`` (default: this metric's states, synced or not), by the contract's one
        reduce over every state this adapter keeps."""
        if blocks is None:
            blocks = []
            for name, spec in self._spec.items():
                value = getattr(self, name)
                blocks += [{name: v} for v in value] if isinstance(value, list) else [{name: value}]
        return merge_states(self._merge_spec, blocks)

    def _value(self, state: dict[str, torch.Tensor], keep: bool = True) -> torch.Tensor:
        guessed = state.pop("_made_up_ids")
        if len(guessed) and bool((guessed == 1).all()):
            _number_afresh(state)
        skipped = dict(zip(state.pop("_skipped_index").tolist(), decode_texts(state.pop("_skipped_reason"))))
        if runner.SIZE_SPEC.keys() <= state.keys():
            size = runner.size_of_rows({k: state.pop(k) for k in runner.SIZE_SPEC})
            if not keep:  # a batch of a stream (forward): its corpus score, if the batch alone can give one
                problem = self.capeval_metric.check_corpus(size)
                if problem is not None:
                    warn_once(("torchmetrics-forward", self._name), (
                        f"{problem.message(self._name)}: the score of one batch (forward) is NaN; compute() "
                        "scores the accumulated corpus"))
                    return torch.tensor(math.nan, dtype=torch.float64, device=self.device)
            self._session.check_fits({self._name: size})
        # a padding DistributedSampler repeats at most world_size - 1 samples, each the same sample: more (ids
        # that are positions in a shard, not dataset indices) or another sample under one id is an error
        state = {name: self._own_spec[name].own_kind(value) for name, value in state.items()}  # as map gave them
        result = self._session.finalize(self._name, state, skipped, allowed_repeats=_world()[1] - 1)
        if keep:
            self._result = self.last_result = result
            self._last_guessed = self._guessed_ids
        return torch.tensor(result.score, dtype=torch.float64, device=self.device)

    def compute(self) -> torch.Tensor:
        _refuse_wrapper(self, "compute")
        return self._value(self._merged_state())

    def compute_all(self) -> MetricResult:
        """Corpus score, per-sample scores (in sample-id order, repeats dropped) and extras.

        With nothing updated since the last ``reset()`` (after ``Trainer.validate``, which computes a logged
        metric at the end of the epoch and resets it), the result of that last computation
        (:attr:`last_result`): the epoch's per-sample scores.

        Under DDP the per-sample rows are filed by the ids given to ``update``; without ids they would follow
        a guess (a non-shuffled sampler's interleaving), wrong for a shuffled one, so they are refused: pass
        ``ids=`` (``compute()``'s corpus score does not depend on them)."""
        kept = self.last_result is not None and self._holds_nothing()
        if self._last_guessed if kept else self._guessed_ids:
            raise ValueError(
                f"{self._name}: per-sample results under torch.distributed need ids=<dataset "
                "indices> in every update(): without them a shuffled sampler's samples are filed under wrong "
                "indices; compute() gives the corpus score")
        if kept:
            return self.last_result
        self.compute()
        assert self._result is not None
        return self._result

    def _refuse_made_up_seeds(self, group_ids: list[int] | None) -> None:
        """A metric whose draws are seeded by sample ids (``Metric.seeded_by_ids``) is refused made-up ids (they
        continue across ``reset()``, so each epoch would draw anew), unless every sample's group id is the index."""
        from capeval_plugins.inputs import InputError, is_name_group

        why = self.capeval_metric.seeded_by_ids()
        if why and (group_ids is None or any(g < 0 or is_name_group(g) for g in group_ids)):
            raise InputError(f"{self._name}: {why}; pass ids=<dataset indices> (or integer group_ids) to update(): "
                             "the ids it would make up change with the metric's history, and so would the scores")

    def _holds_nothing(self) -> bool:
        """Whether no sample was added since the last ``reset()``, by ``update()`` or ``merge_state()``."""
        return all(len(getattr(self, key)) == 0 for key in (INDEX, "_skipped_index"))

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        if _all_ones(self._made_up_ids, empty=False):  # the next made-up ids follow the loaded ones
            self._positions = max([self._positions, *(i + 1 for i in _sample_ids(
                {name: getattr(self, name) for name in self._spec}))])

    def reset(self) -> None:
        # new lists, not torchmetrics' clear() of the old ones in place: a wrapper holding them (Running keeps
        # each update's states for its window) keeps what it holds
        for name, spec in self._spec.items():
            if spec.reduce == "cat":
                setattr(self, name, [])
        super().reset()
        self._seen = 0
        self._ids = set()
        self._guessed_ids = False
        self._last_batch = []
        self._result = None

    def plot(self, val: torch.Tensor | Sequence[torch.Tensor] | None = None, ax: Any = None) -> Any:
        """Plot one value or a series (from ``forward`` or ``compute``; default: ``compute()``), within the
        metric's score range where it has one, as torchmetrics' own metrics do. Needs matplotlib.

        >>> values = [metric(images, captions, ids=ids) for images, captions, ids in loader]  # doctest: +SKIP
        >>> fig, ax = metric.plot(values)  # doctest: +SKIP
        """
        return internals.plot(self, val, ax)

    def __getstate__(self) -> dict[str, Any]:
        _refuse_wrapper(self, "copy")  # BootStrapper deep-copies its metric when it is built
        return super().__getstate__()

    # -- torchmetrics internals ------------------------------------------------------------------------------

    def _apply(self, fn: Any, exclude_state: Sequence[str] = ()) -> Any:
        """``.to(device)``, ``set_dtype(...)``: integer states (sample ids, group ids, digests, sizes) and texts
        move with the metric but are never cast (a float16 id would collide with its neighbours)."""
        kept = [name for name, spec in self._spec.items() if not spec.dtype.is_floating_point]
        return internals.apply_keeping(self, super()._apply, fn, exclude_state, kept)

    def _sync_dist(self, dist_sync_fn=None, process_group=None) -> None:
        internals.sync_cat_states(self, self._spec, dist_sync_fn, process_group, super()._sync_dist)


# torchmetrics wrappers that cannot hold a capeval metric, and why. Running, MinMaxMetric, MetricCollection,
# MultitaskWrapper (inputs (images, captions)) and the arithmetic of metrics work (tests/test_torchmetrics_wrappers.py).
REFUSED_WRAPPERS = {
    "BootStrapper": "it resamples tensor inputs only, so the captions and references (lists) would not follow the "
                    "images; bootstrap the per-sample scores of compute_all() instead (as capeval bench --bootstrap does)",
    "ClasswiseWrapper": "it labels the entries of a per-class tensor, and a capeval metric computes one corpus score "
                        "(compute_all() has the per-sample scores)",
}


def _refuse_wrapper(metric: CapevalMetric, step: str, depth: int = 8) -> None:
    """One line, where a refused torchmetrics wrapper calls ``metric`` (found among the calling frames' ``self``):
    when it copies the metric (BootStrapper, as it is built) or computes it (ClasswiseWrapper)."""
    frame = inspect.currentframe()
    frame = frame.f_back.f_back if frame is not None and frame.f_back is not None else None  # the caller's caller
    while frame is not None and depth:
        owner = frame.f_locals.get("self")
        name = type(owner).__name__
        if name in REFUSED_WRAPPERS and owner is not metric and isinstance(owner, torchmetrics.Metric):
            raise TypeError(f"{type(metric).__name__}: torchmetrics' {name} cannot wrap a capeval metric: "
                            f"{REFUSED_WRAPPERS[name]}")
        frame, depth = frame.f_back, depth - 1


def _number_afresh(state: dict[str, torch.Tensor]) -> None:
    """Made-up ids (positions) replaced by their rank among all the state's ids: the same order, one number per
    sample, whichever updates' states were merged (:data:`MADE_UP_SPEC`)."""
    keys = [key for key in SAMPLE_ID_STATES if key in state]
    values = [state[key].reshape(-1) for key in keys]
    _, dense = torch.unique(torch.cat([v.cpu() for v in values]), return_inverse=True)
    for key, part in zip(keys, torch.split(dense, [len(v) for v in values])):
        state[key] = part.to(state[key].device).reshape(state[key].shape)


def _flat_ids(value: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """An id state (a list of tensors, or one tensor once synced) as one flat tensor on the CPU."""
    parts = [value] if isinstance(value, torch.Tensor) else list(value)
    return torch.cat([p.reshape(-1).cpu() for p in parts]) if parts else torch.empty(0, dtype=torch.int64)


def _sample_ids(state: dict[str, Any]) -> set[int]:
    """The ids of a state's samples, scored or skipped."""
    return set(_flat_ids(state[INDEX]).tolist()) | set(_flat_ids(state["_skipped_index"]).tolist())


def _all_ones(flags: torch.Tensor | Sequence[torch.Tensor], empty: bool) -> bool:
    """Whether every update of a :data:`MADE_UP_SPEC` state made up its ids (``empty``: the answer for none)."""
    flat = _flat_ids(flags)
    return bool((flat == 1).all()) if len(flat) else empty


def _shifted(value: torch.Tensor | Sequence[torch.Tensor], offset: int) -> Any:
    """An id state with ``offset`` added to every id: new tensors, the other metric's are left as they are."""
    return value + offset if isinstance(value, torch.Tensor) else [v + offset for v in value]


def _shown(ids: Sequence[int], limit: int = 10) -> str:
    """``"3, 4, 7"``: the first ``limit`` ids, then how many more."""
    more = f" and {len(ids) - limit} more" if len(ids) > limit else ""
    return ", ".join(str(i) for i in ids[:limit]) + more


def _class_attributes(info: MetricInfo) -> dict[str, Any]:
    attributes: dict[str, Any] = {"higher_is_better": info.higher_is_better}
    if info.score_range is not None:
        low, high = info.score_range
        if math.isfinite(low) and math.isfinite(high):
            attributes.update(plot_lower_bound=float(low), plot_upper_bound=float(high))
    return attributes


metric_class = GeneratedClasses(CapevalMetric, "capeval_plugins.torchmetrics", identifier, _class_attributes)
