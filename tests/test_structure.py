"""Architecture rules that must not rot: one door to the wire, no transformers at runtime."""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "fusion_compute"


def parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once per test process and text: the rules below walk every file
    of the package, most of them more than once (the file's tree is only read). Keyed by the text,
    not the path: a test that writes one path again (test_scanner_catches_an_offender's spellings)
    gets each text's own tree."""
    return _parsed(path.read_text())


@functools.cache
def _parsed(text: str) -> ast.Module:
    return ast.parse(text)


def imports(path: Path) -> frozenset[str]:
    return _imports(path.read_text())


@functools.cache
def _imports(text: str) -> frozenset[str]:
    """Every module a text imports, each `from M import a` as M and M.a (the rules below ask again
    and again, each over every file of the package: walked once per text)."""
    out: set[str] = set()
    for node in ast.walk(_parsed(text)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return frozenset(out)


TRANSPORTS = ("torch.distributed", "ssl", "zmq", "mpi4py")  # what may carry state between participants


def uses_transport(path: Path) -> bool:
    return any(m == e or m.startswith(e + ".") for m in imports(path) for e in TRANSPORTS)


def test_only_the_comm_package_touches_the_wire():
    comm = PKG / "comm"
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if comm not in p.parents and uses_transport(p)]
    assert offenders == [], f"a transport imported outside fusion_compute/comm/: {offenders}"
    assert uses_transport(comm / "links.py") and uses_transport(comm / "torch_fabric.py")
    assert [p.name for p in comm.rglob("*.py") if "torch.distributed" in imports(p)] == ["torch_fabric.py"]


# Raw sockets outside comm/, each for something that carries no participant's state: a new one fails
# the rule below until it is listed here with its reason (or moves into comm/).
RAW_SOCKETS = {
    "runtime/topology.py": "resolves a topology's host names and checks an address is this host's (bind, no data)",
    "runtime/faults.py": "test-only fault injection: shuts a link's socket down (cut), sends nothing",
    "structural/worker.py": "its cut-link fault (as faults.py): shuts a comm link's socket down, sends nothing",
    "cli/serve.py": "binds the OpenAI-compatible API's listening socket (the user's HTTP, not a worker link)",
    "serving/api_server.py": "hands that listening socket to uvicorn",
    "bench/nfq_delay.py": "the benchmark's netfilter-queue delay tool",
    "bench/exchange.py": "the benchmark's raw exchange baseline",
    "bench/one.py": "the benchmark's loopback baseline",
}


def test_raw_sockets_outside_comm_are_the_listed_ones():
    """`socket` is a transport too: outside comm/, only the files listed above (none of which carries
    state between participants) may import it."""
    comm = PKG / "comm"
    users = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if comm not in p.parents and "socket" in imports(p)}
    assert users <= set(RAW_SOCKETS), (
        f"socket imported outside fusion_compute/comm/: {sorted(users - set(RAW_SOCKETS))}"
    )


def test_scanner_catches_an_offender(tmp_path):
    """The rule above can fail: the scanner sees each spelling of the import."""
    for src in (
        "import torch.distributed as dist",
        "from torch.distributed import all_reduce",
        "from torch import distributed",
    ):
        f = tmp_path / "x.py"
        f.write_text(src + "\n")
        found = imports(f)
        assert "torch.distributed" in found or any(m.startswith("torch.distributed") for m in found), src


def test_runtime_does_not_import_transformers():
    allowed = {"reference.py"}  # the test/benchmark reference, imported lazily
    offenders = [
        p.name
        for p in PKG.rglob("*.py")
        if p.name not in allowed and any(m.startswith("transformers") for m in imports(p))
    ]
    assert offenders == [], offenders


def test_only_the_bench_plots_import_matplotlib():
    """Plotting is an optional extra ([plot]): matplotlib is imported by bench/plots.py alone, and
    nothing but the benchmark's commands imports that module."""
    offenders = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if p != PKG / "bench" / "plots.py" and any(m.split(".")[0] == "matplotlib" for m in imports(p))
    ]
    assert offenders == [], offenders
    users = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if any(m.endswith("plots") or ".plots." in m for m in imports(p)) and p.parent.name != "bench"
    ]
    assert users == [], f"outside bench/, imports of the plots: {users}"
    assert "matplotlib" in imports(PKG / "bench" / "plots.py")


# ---- imports flow one way (docs/design.md, "Code habits" 12) ----


def module_graph() -> tuple[dict[str, set[str]], list[str]]:
    """Internal import edges of the package (module -> modules it imports, at any depth in the
    file) and every private name one module imports from another. An import of the package that
    resolves to no module (a file moved without its importers) is recorded in UNRESOLVED."""
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    unresolved = UNRESOLVED
    unresolved.clear()
    for m, p in mods.items():
        base = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(parsed(p)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                pkg = (
                    ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else (node.module or "")
                )
                targets = [((f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg), a.name) for a in node.names]
            for target, name in targets:
                if (target == "fusion_compute" or target.startswith("fusion_compute.")) and target not in mods:
                    unresolved.append(f"{m} imports {target}")
                if target in mods and target != m:
                    edges[m].add(target)
                    if name and name.startswith("_") and not name.startswith("__"):
                        private.append(f"{m} imports {target}.{name}")
    return edges, private


UNRESOLVED: list[str] = []  # filled by module_graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_imports_form_a_dag_with_cli_on_top():
    edges, private = module_graph()
    assert cycles(edges) == [], "import cycles"
    below = [
        m
        for m, t in edges.items()
        if "fusion_compute.cli.main" in t and m not in ("fusion_compute.cli.main", "fusion_compute.__main__")
    ]
    assert below == [], f"imported from below the command line: {below}"
    assert private == [], f"private names imported across modules: {private}"
    assert UNRESOLVED == [], f"imports that resolve to no module: {UNRESOLVED}"


# Which package may import which (each package's __init__ docstring says the same): the model and its
# weights know nothing of sharding or jobs, the weights import the model's config and protocol, never the
# other way, the client's runtime nothing of a mode, generation nothing
# of serving, and the command line sits on top (other packages may use its flag helpers, cli.options).
# The structural worker serves the masked mode through a runner the command line hands it, and the
# bench's control ops are the bench's: structural imports neither masked nor bench.
FORBIDDEN = {
    "model": {"weights", "comm", "structural", "masked", "runtime", "generation", "serving", "cli", "audit", "bench"},
    "weights": {"comm", "structural", "masked", "runtime", "generation", "serving", "cli", "audit", "bench"},
    "comm": {"model", "weights", "structural", "masked", "runtime", "generation", "serving", "cli", "audit", "bench"},
    "runtime": {"structural", "masked", "generation", "serving", "cli", "audit", "bench"},
    "executor": {"model", "weights", "structural", "masked", "generation", "serving", "cli", "audit", "bench"},
    "generation": {"serving", "cli", "audit", "bench"},
    "structural": {"masked", "generation", "serving", "cli", "bench"},
    "masked": {"serving", "cli", "bench"},
}

# Test-only controls (docs/design.md, "Code habits" 13): the honest worker imports none of them; the
# command line chooses them once at start-up (controls/), the masked mode its own dishonest members.
CONTROL_MODULES = {
    "fusion_compute.runtime.faults": {
        "fusion_compute.controls.worker",
        "fusion_compute.masked.controls",
        "fusion_compute.masked.member",
    },
    "fusion_compute.audit.inject": {
        "fusion_compute.controls.worker",
        "fusion_compute.audit.runner",
        "fusion_compute.audit.cli",
    },
    "fusion_compute.structural.megatron": {"fusion_compute.controls.worker"},
}


def control_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {t} (a control: only {', '.join(sorted(ok))} may)"
        for t, ok in CONTROL_MODULES.items()
        for m, ts in edges.items()
        if t in ts and m not in ok
    )


def test_controls_stay_out_of_the_honest_runtime():
    """faults, leaks and the baseline are chosen at start-up, not imported by the worker; the bench's
    control ops are not production opcodes."""
    from fusion_compute.structural.protocol import Op

    edges, _ = module_graph()
    assert control_imports(edges) == []
    assert not {"PROBE", "STATS", "BENCH_RS"} & set(Op.__members__)
    edges["fusion_compute.structural.worker"].add("fusion_compute.runtime.faults")  # the check can fail
    assert control_imports(edges) == [
        "fusion_compute.structural.worker imports fusion_compute.runtime.faults (a control: only "
        "fusion_compute.controls.worker, fusion_compute.masked.controls, fusion_compute.masked.member may)"
    ]


def package_edges(edges: dict[str, set[str]]) -> set[tuple[str, str, str, str]]:
    """(package, package it imports, module, module imported) for every import across packages."""

    def pkg(m: str) -> str:
        parts = m.split(".")
        return parts[1] if len(parts) > 2 or (PKG / parts[-1]).is_dir() else "(top)"

    return {(pkg(m), pkg(t), m, t) for m, ts in edges.items() for t in ts if pkg(m) != pkg(t)}


def layering_violations(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for a, b, m, t in sorted(package_edges(edges)):
        if b in FORBIDDEN.get(a, ()):
            out.append(f"{m} imports {t}")
        if b in ("serving", "controls") and a != "cli":
            out.append(f"{m} imports {t} (only cli may)")
        if b == "cli" and a != "cli" and t != "fusion_compute.cli.options" and m != "fusion_compute.__main__":
            out.append(f"{m} imports {t} (outside cli, only cli.options may be)")
        if (a, b) == ("weights", "model") and t not in ("fusion_compute.model.config", "fusion_compute.model.source"):
            out.append(f"{m} imports {t} (of model/, weights may import only its config and protocol)")
        if (a, b) == ("structural", "audit") and not t.startswith("fusion_compute.audit.verify."):
            # the audit sits above the worker (it runs, injects into and reads structural/); the worker's
            # recorder is handed in at start-up. The verifier's leaf (standard library and audit/schema
            # only, test_audit.py) is shared downward: the plan's picture draws with its drawing.py.
            out.append(f"{m} imports {t} (of audit/, structural may import only the verifier's leaf, audit.verify)")
    return out


def test_packages_import_one_way():
    edges, _ = module_graph()
    assert layering_violations(edges) == []


def test_layering_check_can_fail():
    """An upward import between packages, and an import of a module that does not exist, are seen."""
    edges, _ = module_graph()
    edges["fusion_compute.model.config"].add("fusion_compute.runtime.engine")
    edges["fusion_compute.generation.sampling"].add("fusion_compute.serving.gateway")
    edges["fusion_compute.structural.worker"].add("fusion_compute.audit.recorder")
    edges["fusion_compute.model.dense"].add("fusion_compute.weights.loader")
    edges["fusion_compute.weights.gguf"].add("fusion_compute.model.dense")
    assert layering_violations(edges) == [
        "fusion_compute.generation.sampling imports fusion_compute.serving.gateway",
        "fusion_compute.generation.sampling imports fusion_compute.serving.gateway (only cli may)",
        "fusion_compute.model.config imports fusion_compute.runtime.engine",
        "fusion_compute.model.dense imports fusion_compute.weights.loader",
        "fusion_compute.structural.worker imports fusion_compute.audit.recorder (of audit/, structural may "
        "import only the verifier's leaf, audit.verify)",
        "fusion_compute.weights.gguf imports fusion_compute.model.dense (of model/, weights may import only its "
        "config and protocol)",
    ]


def test_dag_check_can_fail():
    """The checks above see a cycle, an upward import and a private import when there is one."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges, _ = module_graph()
    assert "fusion_compute.cli.main" in edges["fusion_compute.__main__"]  # the graph does see imports of cli


def test_the_command_line_starts_without_torch():
    """`fusion --help`, `fusion keys` and refused arguments answer in a fraction of a second: the parser
    and the key commands do not import torch (about 1.6 s here), nor do `fusion plan` and `fusion audit
    verify` to refuse a path; a run imports it when it starts."""
    import subprocess
    import sys

    refused = [  # (arguments, the refusal): each is checked before the run loads torch or the model
        (["keys", "show", "/nonexistent"], "key file not found"),
        (["generate", "--prompt", "hi", "--top-k", "-1"], "top-k must be >= 0"),
        (["generate", "--prompt", "hi", "--capacity", "1,1,1"], "3 capacities given for 2"),
        (["generate", "--prompt-ids", "1,x"], "comma-separated integers"),
        (["generate", "--prompt", "  "], "empty prompt"),
        (["generate", "--model", "/no/such/model", "--prompt", "hi"], "model not found"),
        (
            ["generate", "--mode", "masked", "--workers", "1+1", "--prompt", "hi", "--max-new-tokens", "0"],
            "max-new-tokens",
        ),
        (["generate", "--mode", "masked", "--workers", "2", "--prompt", "hi"], "--mode masked needs group sizes"),
        (["generate", "--prompt", "hi", "--raw", "--chat"], "opposites"),
        (["plan", "--model", "/no/such/model"], "model not found"),
        (["plan", "--picture", "/no/such/dir/p.svg"], "no such directory"),
        (["audit", "verify", "/no/such/dir"], "no such directory"),
        (["chat", "--mode", "masked", "--workers", "2+2"], "fusion serve --mode masked"),
    ]
    code = (
        "import json, sys; from fusion_compute.cli.main import build_parser, main; build_parser(); "
        f"codes = [main(args) for args in {[args for args, _ in refused]!r}]; "
        "print(json.dumps([codes, 'torch' in sys.modules]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    codes, torch_loaded = json.loads(r.stdout)
    assert not torch_loaded, r.stderr
    assert all(c != 0 for c in codes), codes
    lines = r.stderr.strip().splitlines()
    assert len(lines) == len(refused), r.stderr
    for line, (_, needle) in zip(lines, refused, strict=True):
        assert needle in line, (needle, line)
