"""Human-judgment benchmarks for caption metrics: readers, the protocol each benchmark expects, and a runner
with a per-sample score cache. ``capeval bench`` is the command-line front end; see ``docs/bench.md``.

    from capeval_plugins.bench import run_benchmark
    import capeval_plugins
    report = run_benchmark("flickr8k-expert", "flickr8k.json", {"cider": capeval_plugins.load("cider")})
    print(report.markdown()); report.to_dict()["results"]["cider"]["kendall_tau_c"]
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "BENCHMARKS": "benchmarks", "Benchmark": "benchmarks", "Protocol": "benchmarks", "benchmark_names": "benchmarks",
    "get_benchmark": "benchmarks", "load_benchmark": "benchmarks", "Captions": "data", "Pairs": "data",
    "Ratings": "data", "BenchReport": "runner", "run_benchmark": "runner", "score_metric": "runner",
    "score_metrics": "runner", "verify_results": "verify",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy, so the ``capeval`` parser can list benchmark names without importing torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"capeval_plugins.bench.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'capeval_plugins.bench' has no attribute {name!r}")
