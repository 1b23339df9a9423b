"""Checking what the metrics of a run need before any work: one check, used by every entry point.

Each metric declares its needs (:meth:`capeval_plugins.contract.Metric.requirements`: its models, Java, optional
modules, files); :func:`check` looks for all of them, for every metric of a run, and raises one
:class:`RequirementError` naming each missing piece and what to do, before the first sample is scored (the
runner), or generated (the lm-eval and lmms-eval tasks check when they are built). Nothing is loaded: a model
is found as a local folder, in the Hugging Face cache, or on the hub by one request with a short timeout and
no retries (a typo in a hub id, or a model that is not cached on a machine without network, fails in a
second instead of after a minute of retries and a traceback).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Mapping

from capeval_plugins.contract import Metric, Requirement

HUB_TIMEOUT = 10.0  # seconds for the one hub request of a model that is neither local nor cached


class RequirementError(RuntimeError):
    """A metric's model, runtime or extra is missing: what, for which metric, and what to do (the command line
    prints it in one line and exits with 2)."""


def problems(metrics: Mapping[str, Metric]) -> list[str]:
    """One line per missing requirement of ``metrics`` (name -> metric), each need checked once; a missing Java
    is one line naming every metric and tool that needs it; a GPU a placement option names that this machine
    does not have."""
    found: dict[Requirement, str | None] = {}
    out, java = [], {}
    for name, metric in metrics.items():
        out += [f"{name}: {p}" for p in placement_problems(metric.config)]
        files: dict[tuple, list[str]] = {}  # missing files of one cause (SPICE's two jars): one line
        for need in metric.requirements():
            if need not in found:
                found[need] = problem(need)
            if found[need] is None:
                continue
            if need.kind == "java":
                java.setdefault(name, []).append(need)
            elif need.kind == "file":
                if (need.why, need.remedy) not in files:
                    out.append((need.why, need.remedy))
                files.setdefault((need.why, need.remedy), []).append(need.target)
            else:
                out.append(f"{name}: {found[need]}")
        out = [f"{name}: {missing_files(files[p], *p)}" if isinstance(p, tuple) else p for p in out]
    if java:
        users = ", ".join(f"{name} ({', '.join(n.target for n in needs)})" for name, needs in java.items())
        remedies = dict.fromkeys(n.remedy for needs in java.values() for n in needs if n.remedy)
        out.insert(0, f"{users} need a Java runtime and there is no `java` on PATH: install Java 8 or later "
                      "(e.g. apt-get install default-jre-headless)" + "".join(f", or {r}" for r in remedies))
    if any(need.kind == "java" for need in found):
        from capeval_plugins.resources.java import timeout
        from capeval_plugins.core.messages import ExternalToolError

        try:
            timeout()  # CAPEVAL_JAVA_TIMEOUT read now, not when the first tool starts
        except ExternalToolError as err:
            out.insert(0, str(err))
    return list(dict.fromkeys(out))


def missing_files(targets: list[str], why: str | None, remedy: str | None) -> str:
    """One line for the missing files of one cause: the folder named once when they share it."""
    if len(targets) == 1:
        named, verb = targets[0], "does"
    else:
        folders = {os.path.dirname(t) for t in targets}
        names = [os.path.basename(t) for t in targets] if len(folders) == 1 else targets
        named = ", ".join(names[:-1]) + f" and {names[-1]}" + (f" in {folders.pop()}" if len(folders) == 1 else "")
        verb = "do"
    return f"{why or 'this metric'} needs {named}, which {verb} not exist" + (f": {remedy}" if remedy else "")


def _gpu_indices(value: object) -> list[int]:
    """GPU indices a ``device_map`` / ``max_memory`` value names: ``0``, ``"0"``, ``"cuda"``, ``"cuda:1"``."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, str):
        text = value.strip().lower()
        if text.isdigit():
            return [int(text)]
        if text == "cuda":
            return [0]
        if text.startswith("cuda:") and text[5:].isdigit():
            return [int(text[5:])]
    return []


def placement_problems(config: object) -> list[str]:
    """A ``device_map`` or ``max_memory`` naming a GPU this machine lacks (a CPU-only machine running a
    multi-GPU example): one line each, before anything loads (accelerate would fail later, inside a batch)."""
    device_map, max_memory = getattr(config, "device_map", None), getattr(config, "max_memory", None)
    named: dict[int, str] = {}
    if isinstance(device_map, Mapping):
        for where in device_map.values():
            for i in _gpu_indices(where):
                named.setdefault(i, "device_map")
    elif device_map is not None:
        for i in _gpu_indices(device_map):
            named.setdefault(i, "device_map")
    if isinstance(max_memory, Mapping):
        for key in max_memory:
            for i in _gpu_indices(key):
                named.setdefault(i, "max_memory")
    if not named:
        return []
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = sorted(i for i in named if i >= count)
    if not missing:
        return []
    have = "no CUDA GPU" if count == 0 else f"{count} CUDA GPU{'s' if count > 1 else ''} (0-{count - 1})"
    options = " and ".join(dict.fromkeys(named[i] for i in missing))
    return [f"option {options} names GPU {', '.join(map(str, missing))}, but this machine has {have}: "
            + ("drop the GPU entries (device_map='auto' alone places the model in CPU memory, and on disk with "
               "offload_folder) or run where the GPUs are" if count == 0 else "name the GPUs this machine has")]


def read_model_config(model: str, revision: str | None = None) -> dict | None:
    """A checkpoint's ``config.json`` (a local folder, or the Hugging Face cache; never the network), or None."""
    path = Path(os.path.expanduser(model)) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json", revision=revision)
        except Exception:  # noqa: BLE001  (not a hub id)
            return None
        if not isinstance(found, str):
            return None
        path = Path(found)
    from capeval_plugins.core import jsonio
    from capeval_plugins.resources.loading import MAX_TEXT_FILE

    try:
        if path.stat().st_size > MAX_TEXT_FILE:
            return None  # the loader's folder check names it
        data = jsonio.loads(path.read_bytes())
    except (OSError, ValueError):  # unreadable, not UTF-8 JSON or nested too deeply: the loader says which
        return None
    return data if isinstance(data, dict) else None


def check(metrics: Mapping[str, Metric]) -> None:
    """Raise :class:`RequirementError` naming every missing requirement of ``metrics``."""
    missing = problems(metrics)
    if missing:
        raise RequirementError("; ".join(missing))


def problem(need: Requirement) -> str | None:
    """What is missing for ``need`` and what to do, or None."""
    if need.kind == "java":
        if shutil.which("java") is not None:
            return None
        return (f"{need.target} needs a Java runtime and there is no `java` on PATH: install Java 8 or later"
                + (f", or {need.remedy}" if need.remedy else ""))
    remedy = f": {need.remedy}" if need.remedy else ""
    if need.kind == "device":
        from capeval_plugins.resources.loading import device_problem

        return device_problem(need.target)
    if need.kind == "module":
        if importlib.util.find_spec(need.target) is not None:
            return None
        return f"{need.why or 'this metric'} needs {need.target}, which is not installed{remedy}"
    if need.kind == "file":
        if os.path.isfile(need.target):
            return None
        return f"{need.why or 'this metric'} needs {need.target}, which does not exist{remedy}"
    if need.kind == "model":
        found = model_problem(need.target, need.revision, need.local_files_only)
        return f"{need.why + ': ' if need.why else ''}{found}{remedy}" if found else None
    raise ValueError(f"unknown requirement kind {need.kind!r}")


def model_problem(model: str, revision: str | None = None, local_files_only: bool | None = None) -> str | None:
    """Why checkpoint ``model`` cannot be loaded here, or None: a local path must exist; a hub id must be in
    the Hugging Face cache, or (downloads allowed) exist on a hub that answers one request. A folder found is
    checked as far as it can be without loading (:func:`capeval_plugins.resources.loading.folder_problem`)."""
    from capeval_plugins.resources.loading import folder_problem, local_path_problem

    if os.path.exists(os.path.expanduser(model)):
        return folder_problem(os.path.expanduser(model), revision)  # sizes against weights: before any work
    local = local_path_problem(model)
    if local:
        return local
    if in_hub_cache(model):
        return folder_problem(model, revision)
    from huggingface_hub import constants

    where = f"{model!r} is not a local folder and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if local_files_only or constants.HF_HUB_OFFLINE:
        switch = "local_files_only=True" if local_files_only else "HF_HUB_OFFLINE=1"
        return (f"{where}, and downloads are off ({switch}): give the path of a local copy (./{model} for a folder "
                f"here), or download it first (`hf download {model}` where the hub is reachable)")
    return _hub_problem(model, revision, where)


@functools.lru_cache(maxsize=None)
def _hub_problem(model: str, revision: str | None, where: str) -> str | None:
    """One request to the hub, short timeout, no retries (remembered per process)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        HfApi().model_info(model, revision=revision, timeout=HUB_TIMEOUT)
    except GatedRepoError:
        return None  # it exists; the loader says what access it needs
    except RevisionNotFoundError:
        return f"{model!r} has no revision {revision!r} on the Hugging Face Hub"
    except RepositoryNotFoundError:
        return (f"{where}, and the Hugging Face Hub has no model {model!r} (a typo? a local folder here is "
                f"written ./{model})")
    except Exception as err:  # noqa: BLE001  (no network, DNS, proxy, timeout, server error)
        reason = " ".join(str(err).split()) or type(err).__name__
        return (f"{where}, and the Hugging Face Hub cannot be reached ({reason[:160]}): give the path of a local "
                f"copy (./{model} for a folder here), or download it first (`hf download {model}` "
                "where the hub is reachable)")
    return None


def in_hub_cache(model: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of hub repository ``model``."""
    from huggingface_hub import constants

    if model.count("/") > 1 or not model.strip("/"):
        return False
    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{model.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())
