"""The options of a composite metric, derived from its components' configurations (never copied by hand).

A composite (:class:`~capeval_plugins.contract.CompositeMetric`) declares only its own options (fusion
weights, normalisations) in a dataclass; :func:`derive_config` adds every option of every component, named
``<prefix><option>`` unless a :class:`Part` names it otherwise, with the component's default, type and range
(:func:`~capeval_plugins.core.bounds.bounded`), and :func:`part_options` gives a component its own options back
from a composite configuration. A new option of a component is therefore an option of the composite at once.

``shared`` options (a device, a dtype, the batch size) appear once and go to every component; ``fixed`` ones
are set by the composite (its method needs them) and are not options.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class Part:
    """How one component's options appear on the composite: ``config`` is the component's Config class;
    option ``x`` is ``names[x]`` if given, else ``prefix + x``; ``defaults`` are the composite's defaults where
    its configuration differs from the component's own; ``fixed`` values the composite always passes."""

    config: type
    prefix: str
    names: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)

    def option(self, name: str) -> str:
        return self.names.get(name, self.prefix + name)


# Options every metric has that stay the composite's: what a sample that cannot be scored does is decided once,
# for the whole composite, by the runner.
COMPOSITE_ONLY = ("on_error",)


def derive_config(name: str, base: type, parts: Mapping[str, Part], shared: Sequence[str], module: str) -> type:
    """A dataclass ``name`` subclassing ``base`` (the composite's own options) with every component option.
    Raises if two options would share a name, or a Part renames, re-defaults or fixes an option its component
    does not have."""
    declared = {f.name for f in dataclasses.fields(base)}
    new: dict[str, tuple[Any, dataclasses.Field]] = {}
    paths: list[str] = list(getattr(base, "input_paths", ()))
    for part_name, part in parts.items():
        fields = {f.name: f for f in dataclasses.fields(part.config)}
        unknown = sorted((set(part.names) | set(part.defaults) | set(part.fixed)) - set(fields))
        if unknown:
            raise TypeError(f"{name}: component {part_name!r} has no option(s) {unknown}")
        hints = typing.get_type_hints(part.config)
        for option, f in fields.items():
            if option in part.fixed or option in COMPOSITE_ONLY:
                continue
            if option in shared:  # once, from the first component that has it, unless the composite declares it
                if option not in declared and option not in new:
                    new[option] = (hints[option], _copy(f, f.default))
                continue
            target = part.option(option)
            if target in declared or target in new:
                raise TypeError(f"{name}: option {target!r} of component {part_name!r} clashes with another option")
            new[target] = (hints[option], _copy(f, part.defaults.get(option, f.default)))
            if option in getattr(part.config, "input_paths", ()):
                paths.append(target)
    namespace = {"input_paths": tuple(dict.fromkeys(paths)), "__doc__": base.__doc__}
    cls = dataclasses.make_dataclass(name, [(k, t, f) for k, (t, f) in new.items()], bases=(base,),
                                     namespace=namespace)
    cls.__module__ = module  # where it is defined (pickling, reprs); make_dataclass's module= needs Python 3.12
    return cls


def _copy(f: dataclasses.Field, default: Any) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING and default is dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=default, metadata=f.metadata)


def part_options(config: Any, part: Part, shared: Sequence[str]) -> dict[str, Any]:
    """The component's options from a composite configuration: its own (renamed back), the shared ones, and the
    composite's fixed values."""
    out = {}
    for f in dataclasses.fields(part.config):
        if f.name in part.fixed:
            out[f.name] = part.fixed[f.name]
        elif f.name in shared:
            out[f.name] = getattr(config, f.name)
        elif f.name not in COMPOSITE_ONLY:
            out[f.name] = getattr(config, part.option(f.name))
    return out
