"""Metric options from the outside world: typed parsing of ``key=value`` strings, routing of options to
the metrics of a run, and building those metrics (:func:`build_metrics`), shared by the command line, its
subcommands (``capeval bench``) and the pycocoevalcap drop-in.

Routing: an option addressed to one metric (``clipscore.model=...`` on the command line, or a per-metric
mapping) goes to that metric and must be one of its options; a bare option goes to every selected metric
that takes it, and one that no selected metric takes is an error (a typo, or an image metric's option given
to a text metric alone).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from capeval_plugins.core import jsonio
from capeval_plugins.inputs import InputError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class OptionError(InputError):
    """An option that is unknown, misaddressed or of the wrong type."""


def fields(config_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(config_cls)}


def parse_value(metric: str, key: str, raw: str, field: dataclasses.Field) -> Any:
    """``raw`` as the type the option's annotation names (``int``, ``float``, ``bool``, ``str``, ``None``,
    else JSON)."""
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    kinds = [k.strip() for k in annotation.split("|")]
    text = raw.strip()
    if text.lower() in ("none", "null") and ("None" in kinds or field.default is None):
        return None
    structured = text[:1] in "[{" and any(k not in ("str", "None") for k in kinds)
    if structured:
        try:
            return jsonio.loads(text)
        except json.JSONDecodeError:
            pass
    for kind in kinds:
        if kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
        elif kind in ("int", "float"):
            try:
                return int(text) if kind == "int" else float(text)
            except ValueError:
                pass
        elif kind == "str":
            return raw
    if all(k in ("bool", "int", "float", "None") for k in kinds):
        wanted = " or ".join(k if k != "None" else "none" for k in kinds)
        raise OptionError(f"{metric}: option {key} expects {_article(wanted)}, got {raw!r}")
    try:
        return jsonio.loads(text)
    except json.JSONDecodeError:
        return raw


def _article(kind: str) -> str:
    return ("an " if kind[:1] in "aeiou" else "a ") + kind


def parse_pairs(pairs: Sequence[str], names: Sequence[str]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``key=value`` and ``metric.key=value`` strings -> (bare options, options by metric), values as text. One
    option given twice with different values is refused (neither silently wins)."""
    bare: dict[str, str] = {}
    own: dict[str, dict[str, str]] = {}

    def put(where: dict[str, str], key: str, raw: str, pair: str) -> None:
        if key in where and where[key] != raw:
            shown = pair.partition("=")[0].strip()
            raise OptionError(f"option {shown} is given twice ({where[key]!r} and {raw!r}); give it once")
        where[key] = raw

    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise OptionError(f"--option expects key=value or metric.key=value, got {pair!r}")
        target, dot, name = key.rpartition(".")
        if dot:
            if target not in names:
                raise OptionError(f"option {pair!r} names metric {target!r}, which is not selected ({', '.join(names)})")
            put(own.setdefault(target, {}), name, raw, pair)
        else:
            put(bare, key, raw, pair)
    return bare, own


def route(classes: Mapping[str, type], bare: Mapping[str, Any], own: Mapping[str, Mapping[str, Any]],
          parse: bool = False) -> dict[str, dict[str, Any]]:
    """Options for every metric (``classes``: name -> Metric class). ``parse`` turns text values into typed
    ones (command line)."""
    out: dict[str, dict[str, Any]] = {name: {} for name in classes}
    for key, value in bare.items():
        takers = [name for name, cls in classes.items() if key in fields(cls.Config)]
        if not takers:
            raise OptionError(f"no selected metric takes option {key!r} ({_valid(classes)})")
        for name in takers:
            out[name][key] = parse_value(name, key, value, fields(classes[name].Config)[key]) if parse else value
    for name, options in own.items():
        known = fields(classes[name].Config)
        for key, value in options.items():
            if key not in known:
                raise OptionError(f"{name} takes no option {key!r}; valid: {', '.join(sorted(known))}")
            out[name][key] = parse_value(name, key, value, known[key]) if parse else value
    return out


def _valid(classes: Mapping[str, type]) -> str:
    return "; ".join(f"{name} takes {', '.join(sorted(fields(cls.Config)))}" for name, cls in classes.items())


def build_metrics(names: Sequence[str], pairs: Sequence[str],
                  shared: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The selected metrics (registered names), each with its options: ``key=value`` to every selected metric
    that takes it, ``metric.key=value`` to one; ``shared`` are more bare options (``--model``, ...). A metric
    named twice, an option given twice with different values (``--model A -o model=B`` too), an option no
    metric takes or a value a metric refuses raises :class:`OptionError`."""
    from capeval_plugins import registry

    entries = {}
    for name in names:
        entry = registry.get(name)
        entries[entry.info.name] = entry.cls
    if len(entries) != len(names):
        raise OptionError("a metric is selected twice")
    bare, own = parse_pairs(pairs, list(entries))
    for key, value in (shared or {}).items():
        if key in bare and bare[key].strip() != str(value).strip():
            flag = "--" + key.replace("_", "-")
            raise OptionError(f"{flag} {value} and -o {key}={bare[key]} disagree; give one of them")
        bare[key] = value
    routed = route(entries, bare, own, parse=True)
    metrics = {name: built(cls, routed[name]) for name, cls in entries.items()}
    if "model" in bare:
        check_shared_model(bare["model"], [n for n in entries if "model" not in own.get(n, {})], entries,
                           "--model" if shared and "model" in shared else "-o model")
    return metrics


def built(cls: type, options: Mapping[str, Any]) -> Any:
    """``cls(**options)``, an unknown option or a refused value as :class:`OptionError` naming the metric."""
    name = cls.info.name
    try:
        return cls(**options)
    except (TypeError, ValueError) as err:
        raise OptionError(f"{err}" if name in str(err) else f"{name}: {err}") from None


def check_shared_model(model: str, takers: Sequence[str], classes: Mapping[str, type], flag: str) -> None:
    """A model given to every selected metric that takes one must suit each (``-m clipscore -m bertscore --model
    <a CLIP>``): read from the checkpoint's config.json (a local folder or the Hugging Face cache; nothing is
    loaded), a metric's ``model_kind_problem`` refuses it, with the per-metric option as the fix."""
    from capeval_plugins.preflight import read_model_config

    checks = {n: getattr(classes[n], "model_kind_problem", None) for n in takers if "model" in fields(classes[n].Config)}
    checks = {n: c for n, c in checks.items() if c is not None}
    if not checks:
        return
    config = read_model_config(model)
    if config is None:
        return
    bad = {n: p for n, c in checks.items() if (p := c(config))}
    if bad:
        name, problem = next(iter(bad.items()))
        fix = " ".join(f"-o {n}.model=..." for n in takers if "model" in fields(classes[n].Config))
        raise OptionError(f"{flag} {model} goes to every selected metric that takes a model, and {name} cannot use "
                          f"it: {problem}; give each metric its own: {fix}")
