"""What the package reads of accelerate's internals, in one place: the hook accelerate attaches to every module it
dispatched (a model spread over devices, or offloaded, by a ``device_map``) is the module's ``_hf_hook``
attribute, and the device a hook computes on its ``execution_device``. accelerate has no public way to ask
either of a loaded model. accelerate itself is optional (the ``accelerate`` extra): without it no module has a hook.
"""
from __future__ import annotations

from typing import Any

HOOK = "_hf_hook"


def dispatch_hook(module: Any) -> Any:
    """The accelerate hook on ``module``, or None (a module on one device)."""
    return getattr(module, HOOK, None)


def execution_device(module: Any) -> Any:
    """The device the hook on ``module`` runs its forward pass on, or None."""
    return getattr(dispatch_hook(module), "execution_device", None)
