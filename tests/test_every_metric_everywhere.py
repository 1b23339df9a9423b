"""Every registered metric is reachable from every ecosystem through the generic adapters (no model is
loaded: constructors are lazy), with the shapes each ecosystem expects."""
from __future__ import annotations

import pytest

from capeval_plugins import registry

NAMES = sorted(registry.metrics())


@pytest.mark.parametrize("name", NAMES)
def test_evaluate_torchmetrics_pycocoevalcap_and_lm_eval_know_it(name):
    import evaluate
    import lm_eval.api.registry as lm_registry

    import capeval_plugins.lm_eval  # noqa: F401  (registers)
    from capeval_plugins.adapters.hf_evaluate import CANONICAL
    from capeval_plugins.adapters.naming import coco_identifier, identifier
    from capeval_plugins.adapters.torchmetrics import CapevalMetric
    from capeval_plugins.pycocoevalcap import CapevalScorer

    info = registry.get(name).info
    try:
        module = evaluate.load(f"capeval/{name}")
    except (ValueError, RuntimeError) as err:
        # A metric whose prerequisite is missing here (Rigel's trained checkpoint, SPICE's CoreNLP jars)
        # refuses to build, naming itself and the remedy.
        assert name in str(err).lower() and len(str(err)) > 60, err
    else:
        if name not in CANONICAL:
            assert type(evaluate.load(name)) is type(module)
        features = module.features if isinstance(module.features, list) else [module.features]
        keys = set(features[0])
        assert "predictions" in keys
        assert ("images" in keys) == (info.images != "never")
        assert ("references" in keys) == (info.references != "never")
        assert ("group_ids" in keys) == info.groups

    import capeval_plugins.torchmetrics as tm

    cls = getattr(tm, identifier(info))  # its own class, named after it alone (PAC-S++: PACSPlusPlus, not PACS)
    assert issubclass(cls, CapevalMetric) and cls.higher_is_better == info.higher_is_better
    assert cls._capeval_name == name and cls.__name__ == identifier(info) and cls.__name__ in dir(tm)

    import capeval_plugins.pycocoevalcap as coco

    scorer = getattr(coco, coco_identifier(info))
    assert issubclass(scorer, CapevalScorer) and scorer._capeval_name == name and scorer.__name__ in dir(coco)
    assert f"capeval/{name}" in lm_registry.metric_registry
    assert lm_registry.get_aggregation(f"capeval/{name}") is not None
