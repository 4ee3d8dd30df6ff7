"""Architecture rules that must not rot: one door to the wire, no transformers at runtime."""

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


ENGINES = ("torch.distributed", "ssl", "zmq", "mpi4py")  # what may carry state between participants


def uses_engine(path: Path) -> bool:
    return any(m == e or m.startswith(e + ".") for m in imports(path) for e in ENGINES)


def test_only_the_comm_package_touches_the_wire():
    comm = PKG / "comm"
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if comm not in p.parents and uses_engine(p)]
    assert offenders == [], f"a wire engine imported outside fusion_compute/comm/: {offenders}"
    assert uses_engine(comm / "links.py") and uses_engine(comm / "torch_fabric.py")
    assert [p.name for p in comm.rglob("*.py") if "torch.distributed" in imports(p)] == ["torch_fabric.py"]


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
