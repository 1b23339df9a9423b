"""The session: one streaming pass of some metrics over samples that arrive in batches, and the one batch loop
every entry point feeds. :func:`capeval_plugins.runner.run` (``capeval score``, the evaluate, pycocoevalcap,
lm-eval and lmms-eval adapters, ``Metric.__call__``), ``capeval bench``, the torchmetrics adapter's ``update`` /
``forward`` / ``compute`` and MID's reference fit all open a :class:`Session` and run their batches through
:meth:`Session.run`, so the checks, the errors, the batching, the decoding shared across metrics, the bisection of
a failing batch, the skip policy and the merge are the same everywhere:

1. **open**: what every metric needs from the machine (its models, Java, extras:
   :mod:`capeval_plugins.preflight`) and the local files its options name, before any work;
2. **validate** every caption, image (file header, array layout), reference list and list length, for every
   metric, before any model is loaded (:mod:`.corpus`). Problems are reported together, each naming the
   sample's own index (the ``ids`` given, a caption file's row, else the position in the user's lists), never
   a position inside a batch or a shard. ``on_error="skip"`` scores the rest instead and records the skipped
   samples, with their reason, in the result; then every metric's ``check_corpus`` on the samples it will
   score (MID's Gaussian needs more pairs than dimensions): one :class:`InputError` before any model loads (a
   stream, which learns its corpus batch by batch, checks it at ``compute()``, before the result);
3. **plan and run** (:mod:`.loop`): each metric's samples in batches (an image's captions together, a batch
   ending at an image boundary wherever the next image does not fit), every metric's batches in one
   interleaved order, the next batch's images decoded ahead; each batch mapped (:mod:`.mapping`: images decoded
   once for all metrics of a pass, a batch too large to hold decoded mapped in pieces, a failing batch bisected
   to its failing samples, skipped or raised per the policy), its rows kept and its sums added, then handed to
   the caller's hook (a checkpoint, a score cache); a stop asked for ends the pass after a batch;
4. **merge** (:func:`~capeval_plugins.contract.merge_states`, the one reduce: ``"cat"`` rows concatenated,
   ``"sum"`` statistics added; per batch, per rank, across ranks) and **finalize** (rows in index order,
   repeats checked, skipped samples back in place).

What the callers add around a pass: :mod:`capeval_plugins.runner` shards a corpus over ranks, checkpoints each
batch and gathers the ranks; the torchmetrics adapter keeps each ``update()``'s pass in its states;
:mod:`capeval_plugins.bench.runner` plans only what its score cache lacks and caches each finished batch. Only
generation runs batches of its own: :mod:`capeval_plugins.captioning` drives a captioner over the distinct images
(decoding each for the captioner) before its captions enter this loop like any others, and the lm-eval / lmms-eval
harnesses generate before they score.
"""
from capeval_plugins.session.corpus import (SIZE_SPEC, Corpus, Describe, check_paths, checks_corpus,  # noqa: F401
                                            corpus_size, policy, size_of_rows, size_rows, validate)
from capeval_plugins.session.loop import (Finished, Folded, Outcome, Plan, Session, StopFlag,  # noqa: F401
                                          schedule)
from capeval_plugins.session.mapping import (BATCH_IMAGE_BYTES, IMAGE_CACHE_BYTES, not_a_sample_fault,  # noqa: F401
                                             OWN_METRICS, ImageCache, RowOrderError, build_batch, check_row_order,
                                             finalize, image_bytes, image_cache, image_pieces, map_part)
