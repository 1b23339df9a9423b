"""The pinned test environments: resolve them anew, or check that a Python can use them.

``make test`` builds ``.venv``, ``.venv-lmms`` and ``.venv-lowest`` from ``requirements/main.txt``,
``requirements/lmms.txt`` and ``requirements/lowest.txt`` (every package, direct and transitive, at one version,
installed with ``--no-deps``), so one commit builds the same environments on any day. ``main`` and ``lmms`` are
the newest versions pyproject.toml's ranges allow; ``lowest`` the lowest (every requirement of pyproject.toml at
the lowest version its range allows, what they pull in at the newest that fit: uv's lowest-direct resolution with
the floors as constraints), except torch, kept at the CPU build the main set pins (an older torch is a CUDA build of
several GB here): the suite's fast part runs on it, so a range that claims a version nothing runs on fails there.
No environment holds a CUDA package (``nvidia-*``, ``cuda-*``, ``triton``): a resolution that brings one in stops,
naming it. Upgrading is a deliberate step:

    make lock        # = python3 tools/pins.py refresh, then make test on the new pins

``refresh`` resolves each environment afresh from pyproject.toml's ranges in a scratch venv under
``.cache/pins/``, writes the lock files and prints what changed; review the diff, run the suite, commit both.
``check-python`` (run by the Makefile before it builds a venv) refuses a Python other than the one the pins
were resolved on, since a pin may have no wheel for another.

Standard library only: it runs before any venv exists.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "capeval-plugins"
LOCKS = ROOT / "requirements"
SCRATCH = ROOT / ".cache" / "pins"

# The CPU build of torch the machines carry (the local label names the build: PyPI's plain 2.13.0 is the CUDA build,
# which pulls in 3.5 GB of nvidia-* and triton), and the torchvision built for it (installed only so pip keeps
# that torch while it resolves lmms-eval, then removed: PyPI's torchvision does not load beside the CPU torch,
# and lmms-eval's core does not need it).
TORCH = os.environ.get("TORCH", "torch==2.13.0+cpu")
# Where the CPU builds of torch are published, for a machine whose pip sources hold none (uv_sources).
TORCH_CPU_INDEX = os.environ.get("TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")
# Packages of a CUDA build: none belongs in an environment the suite runs on the CPU.
CUDA_PACKAGES = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
LMMS_TORCHVISION = os.environ.get("LMMS_TORCHVISION", "torchvision==0.28.*")

# environment -> (pip install arguments after torch, packages removed afterwards)
ENVIRONMENTS = {
    "main": ([".[all,test]"], []),
    "lmms": ([".[all,test,lmms]", LMMS_TORCHVISION, "decord"], ["torchvision"]),
}
# Resolved by uv at the lowest versions (see the module's docstring), not installed to be frozen.
LOWEST = "lowest"
LOWEST_EXTRAS = ["all", "test"]
UV = os.environ.get("UV") or (ROOT / "requirements" / "uv.txt").read_text().split()[0]  # the Makefile's uv too
# Build tools of the editable install (no isolation): at the main lock's versions.
BUILD_TOOLS = ["editables", "hatchling", "packaging", "pathspec", "pluggy", "tomlkit", "trove-classifiers"]
HEADER = "# pinned:"
# Packages whose wheels are downloaded for files they ship (real tokenizers), never installed.
FILE_PACKAGES = ["dashscope", "mistral-common"]


def _pip(venv: Path, *args: str) -> str:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return proc.stdout


def resolve(name: str) -> list[str]:
    """Build a scratch venv from pyproject.toml's ranges (today's newest that fit) and freeze it."""
    installs, removals = ENVIRONMENTS[name]
    venv = SCRATCH / name
    print(f"[{name}] resolving in {venv.relative_to(ROOT)} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    _pip(venv, "install", "-q", "--upgrade", "pip", "hatchling", "editables")  # the editable build, no isolation
    _pip(venv, "install", "-q", TORCH)
    _pip(venv, "install", "-q", "--no-build-isolation", "-e", *installs)
    if removals:
        _pip(venv, "uninstall", "-q", "-y", *removals)
    frozen = _pip(venv, "freeze", "--all", "--exclude-editable").splitlines()
    return refuse_cuda(name, sorted((line for line in frozen if line and not line.startswith("#")), key=str.lower))


def cuda_packages(pins: list[str]) -> list[str]:
    """The packages of a CUDA build among ``pins`` (``name==version`` lines)."""
    return sorted(name for name in _versions(pins) if CUDA_PACKAGES.match(name))


def refuse_cuda(name: str, pins: list[str]) -> list[str]:
    found = cuda_packages(pins)
    if found:
        sys.exit(f"[{name}] the resolution brought in CUDA packages ({', '.join(found)}): torch resolved to a CUDA "
                 f"build. Pin the CPU build (TORCH={TORCH!r}) from a source that has it (TORCH_CPU_INDEX).")
    return pins


def floors() -> list[str]:
    """Every requirement of pyproject.toml (with :data:`LOWEST_EXTRAS`) at the lowest version its range allows,
    as uv constraints (``name==<floor>.*``), torch left out (:data:`TORCH`)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines, todo, done = list(project["dependencies"]), list(LOWEST_EXTRAS), set()
    while todo:  # extras, and extras that name other extras ("capeval-plugins[...]")
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for line in project["optional-dependencies"][extra]:
            match = re.fullmatch(r"capeval-plugins\[([^\]]+)\]", line.strip())
            if match:
                todo += match.group(1).split(",")
            else:
                lines.append(line)
    out = {}
    for line in lines:
        name = re.match(r"[A-Za-z0-9_.\-]+", line).group(0)
        floor = re.search(r">=\s*([0-9][^,;\s]*)", line)
        if floor and name.lower() != "torch" and name.lower() not in out:
            version = floor.group(1)
            out[name.lower()] = f"{name}=={version}" if version.count(".") >= 2 else f"{name}=={version}.*"
    return list(out.values())


def resolve_lowest() -> list[str]:
    """pyproject.toml's requirements (with :data:`LOWEST_EXTRAS`) each at its floor (:func:`floors`), what they
    pull in at the newest versions that fit (uv's lowest-direct resolution for this Python), torch overridden to
    :data:`TORCH`; plus the build tools at the main lock's versions. Floors that cannot go together fail here,
    with uv's explanation: raise the floor it names in pyproject.toml."""
    venv = SCRATCH / "uv"
    print(f"[{LOWEST}] resolving with {UV} in {venv.relative_to(ROOT)} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    _pip(venv, "install", "-q", UV)
    override, constraints = SCRATCH / "lowest-override.txt", SCRATCH / "lowest-floors.txt"
    override.write_text(TORCH + "\n")
    constraints.write_text("\n".join(floors()) + "\n")
    proc = subprocess.run(lowest_command(venv / "bin" / "uv", override, constraints), cwd=ROOT, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"the floors of pyproject.toml do not go together (raise the one named):\n{proc.stderr[-4000:]}")
    pins = [line.strip() for line in proc.stdout.splitlines() if "==" in line and not line.startswith("#")]
    have = {_versions([p]).popitem()[0] for p in pins}
    main = _versions(read_lock("main"))
    pins += [f"{tool}=={main[tool]}" for tool in BUILD_TOOLS if tool not in have and tool in main]
    return refuse_cuda(LOWEST, sorted(pins, key=str.lower))


def lowest_command(uv: Path, override: Path, constraints: Path) -> list[str]:
    """uv's lowest-direct resolution of pyproject.toml with :data:`LOWEST_EXTRAS`, torch overridden to the CPU
    build (:data:`TORCH`), from the sources pip is configured with here (:func:`uv_sources`: where the CPU
    build lies; PyPI alone has only the CUDA build of a plain version)."""
    return [str(uv), "pip", "compile", "pyproject.toml", *[a for e in LOWEST_EXTRAS for a in ("--extra", e)],
            "--resolution", "lowest-direct", "--python-version", "{}.{}".format(*sys.version_info[:2]),
            "--override", str(override), "--constraint", str(constraints), *uv_sources(),
            "--no-header", "--no-annotate", "--quiet"]


def resolve_files() -> list[str]:
    """The newest wheel of each of :data:`FILE_PACKAGES`, by name and version (downloaded, not installed)."""
    folder = SCRATCH / "files"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[files] downloading {', '.join(FILE_PACKAGES)} ...", flush=True)
    out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                          "-d", str(folder), *FILE_PACKAGES], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"pip download failed:\n{out.stderr[-3000:]}")
    pins = []
    for package in FILE_PACKAGES:
        stem = package.replace("-", "_")
        versions = sorted((w.name.split("-")[1] for w in folder.glob(f"{stem}-*.whl")), key=_version_key)
        pins.append(f"{package}=={versions[-1]}")
    return pins


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version))


def _versions(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        if "==" in line and not line.startswith("#"):
            pkg, version = line.split("==", 1)
            out[re.sub(r"[-_.]+", "-", pkg).lower()] = version.strip()
    return out


def read_lock(name: str) -> list[str]:
    path = LOCKS / f"{name}.txt"
    return path.read_text().splitlines() if path.exists() else []


def changes(old: list[str], new: list[str]) -> list[str]:
    before, after = _versions(old), _versions(new)
    rows = []
    for pkg in sorted(before.keys() | after.keys()):
        a, b = before.get(pkg), after.get(pkg)
        if a != b:
            rows.append(f"  {pkg}: {a or '(new)'} -> {b or '(removed)'}")
    return rows


def write_lock(name: str, pins: list[str]) -> None:
    LOCKS.mkdir(exist_ok=True)
    stamp = datetime.date.today().isoformat()
    what = ("# Wheels `make test` downloads (--no-deps, never installed) for the real tokenizers they ship."
            if name == FILES else
            "# The lowest versions pyproject.toml's ranges allow (uv lowest-direct; torch kept at the machines' CPU "
            "build): `make test` installs them with --no-deps and runs the suite's fast part." if name == LOWEST else
            "# Every package of the test environment at one version: `make test` installs it with --no-deps.")
    header = [
        f"{HEADER} python {platform.python_version()} {sys.platform} {platform.machine()} on {stamp}", what,
        "# Do not edit: `make lock` resolves pyproject.toml's ranges anew and rewrites this file (tools/pins.py).",
    ]
    (LOCKS / f"{name}.txt").write_text("\n".join(header + pins) + "\n")


FILES = "tokenizer-files"


def refresh(names: list[str]) -> None:
    for name in names:
        old = read_lock(name)
        new = resolve_files() if name == FILES else resolve_lowest() if name == LOWEST else resolve(name)
        write_lock(name, new)
        rows = changes(old, new)
        print(f"[{name}] requirements/{name}.txt: {len(new)} packages, {len(rows)} changed")
        print("\n".join(rows) if rows else "  (no change)")


def check_python(name: str) -> None:
    """Refuse a Python whose major.minor differs from the one the lock was resolved on."""
    lines = read_lock(name)
    if not lines:
        sys.exit(f"requirements/{name}.txt is missing: run `make lock`")
    match = re.match(rf"{re.escape(HEADER)} python (\d+\.\d+)", lines[0])
    wanted = match.group(1) if match else None
    have = "{}.{}".format(*sys.version_info[:2])
    if wanted and wanted != have:
        sys.exit(f"requirements/{name}.txt was resolved on Python {wanted}; this is Python {have}. "
                 f"Use PYTHON=python{wanted} make ..., or resolve for this Python with `make lock`.")


# Where ``pip install`` takes an option from, the first that sets it winning: a PIP_* variable (``:env:`` in
# ``pip config list``), then the config files' ``[install]`` section, then their ``[global]`` one.
PIP_SCOPES = (":env:", "install", "global")


def uv_sources() -> list[str]:
    """pip's package sources on this machine (index, extra indexes, wheel folders; from its config files and
    PIP_* variables, each option from where ``pip install`` takes it) as uv arguments, so uv installs the pins
    from where pip would; uv takes the best match over all of them, as pip does. Where no local source holds
    the CPU build of torch the locks pin, PyTorch's CPU index (:data:`TORCH_CPU_INDEX`) is added."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    found: dict[str, dict[str, list[str]]] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        scope, _, option = key.rpartition(".")
        if scope in PIP_SCOPES:  # not [download], [wheel], ...: sections of other pip commands
            found.setdefault(option, {})[scope] = value.strip().strip("'\"").split()
    args, sources = [], []
    for option in ("index-url", "extra-index-url", "find-links"):
        by_scope = found.get(option, {})
        values = next((by_scope[s] for s in PIP_SCOPES if s in by_scope), [])
        for item in values[:1] if option == "index-url" else values:
            args += [f"--{option}", item]
            sources.append(item)
    if not any(_offers_cpu_torch(source) for source in sources):
        args += ["--extra-index-url", TORCH_CPU_INDEX]  # PyPI has only the CUDA build of the pinned torch
    return [*args, "--index-strategy", "unsafe-best-match"]


def _offers_cpu_torch(source: str) -> bool:
    """Whether a local wheel folder or ``file://`` simple index among pip's sources holds :data:`TORCH`'s wheel
    (this machine's copy); a remote source is not asked."""
    wheel = "torch-" + TORCH.split("==", 1)[1]
    path = Path(source[len("file://"):] if source.startswith("file://") else source)
    if "://" in source and not source.startswith("file://"):
        return False
    if path.is_dir() and any(path.glob(f"{wheel}-*.whl")):
        return True
    listing = path / "torch" / "index.html"
    return listing.is_file() and any(w in listing.read_text(errors="replace") for w in (wheel, wheel.replace("+", "%2B")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("refresh", help="resolve the environments anew, write requirements/*.txt, show changes")
    r.add_argument("names", nargs="*", metavar="ENV",
                   help=f"{' / '.join([*ENVIRONMENTS, LOWEST, FILES])} (default: all)")
    c = sub.add_parser("check-python", help="exit 1 unless this Python is the one the lock was resolved on")
    c.add_argument("name", choices=[*ENVIRONMENTS, LOWEST])
    sub.add_parser("uv-sources", help="print pip's package sources as uv arguments (the Makefile installs with uv)")
    args = parser.parse_args(argv)
    if args.command == "refresh":
        known = [*ENVIRONMENTS, LOWEST, FILES]
        unknown = set(args.names) - set(known)
        if unknown:
            parser.error(f"unknown environment {sorted(unknown)}: choose from {known}")
        refresh(args.names or known)
    elif args.command == "uv-sources":
        print(" ".join(uv_sources()))
    else:
        check_python(args.name)


if __name__ == "__main__":
    main()
