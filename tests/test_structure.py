"""Architecture rules that must not rot: one door to torch.distributed, no transformers at runtime."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "fusion_compute"


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_only_comm_imports_torch_distributed():
    offenders = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if p.name != "comm.py" and any(m == "torch.distributed" or m.startswith("torch.distributed.") for m in imports(p))
    ]
    assert offenders == [], f"torch.distributed imported outside comm.py: {offenders}"
    assert "torch.distributed" in imports(PKG / "comm.py")


def test_scanner_catches_an_offender(tmp_path):
    """The rule above can fail: the scanner sees each spelling of the import."""
    for src in ("import torch.distributed as dist", "from torch.distributed import all_reduce",
                "from torch import distributed"):  # fmt: skip
        f = tmp_path / "x.py"
        f.write_text(src + "\n")
        found = imports(f)
        assert "torch.distributed" in found or any(m.startswith("torch.distributed") for m in found), src


def test_runtime_does_not_import_transformers():
    allowed = {"reference.py"}  # the test/benchmark reference, imported lazily
    offenders = [
        p.name for p in PKG.rglob("*.py") if p.name not in allowed and any(m.startswith("transformers") for m in imports(p))
    ]
    assert offenders == [], offenders
