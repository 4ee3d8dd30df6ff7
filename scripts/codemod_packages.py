"""The codemod that grouped fusion_compute's flat top level into packages by role (issue 22, item 3).

Kept as the record of how the tree was moved, and rerunnable on a branch that still has the flat
layout (it does nothing on a tree already moved). What it does, from the repository root:

  1. every dotted name `fusion_compute.X` and path `fusion_compute/X.py` of a moved module, in any
     Python, Markdown, TOML or shell file, is rewritten (absolute imports, monkeypatch targets,
     `python -m`, docs);
  2. every relative import in fusion_compute/ is resolved against the OLD layout and re-emitted,
     relative, from the importing file's NEW place, and a test's `from fusion_compute import <module>`
     follows its module (names imported from a package that are modules, `from . import architecture
     as arch`, follow their module too);
  3. the files move with `git mv`, and each new package gets its `__init__.py` docstring.

Usage: python scripts/codemod_packages.py [--dry-run]
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "fusion_compute"

# old top-level module -> new dotted path under fusion_compute
MOVES = {
    "config": "model.config",
    "architecture": "model.architecture",
    "kernels": "model.kernels",
    "dense": "model.dense",
    "reference": "model.reference",
    "source": "weights.source",
    "weights": "weights.loader",
    "gguf": "weights.gguf",
    "gguf_index": "weights.gguf_index",
    "tokenizer": "weights.tokenizer",
    "plan": "structural.plan",
    "ops": "structural.ops",
    "sharded": "structural.sharded",
    "megatron": "structural.megatron",
    "worker": "structural.worker",
    "client": "structural.client",
    "protocol": "structural.protocol",
    "engine": "runtime.engine",
    "engine_options": "runtime.engine_options",
    "membership": "runtime.membership",
    "launch": "runtime.launch",
    "topology": "runtime.topology",
    "faults": "runtime.faults",
    "progress": "runtime.progress",
    "generate": "generation.generate",
    "batching": "generation.batching",
    "sampling": "generation.sampling",
    "sampling_params": "generation.sampling_params",
    "result": "generation.result",
    "gateway": "serving.gateway",
    "scheduler": "serving.scheduler",
    "api_server": "serving.api_server",
    "openai_protocol": "serving.openai_protocol",
    "http_limits": "serving.http_limits",
    "admin_api": "serving.admin_api",
    "control_page": "serving.control_page",
    "picture": "structural.picture",
    "cli": "cli.main",
    "options": "cli.options",
    "serve": "cli.serve",
    "chat": "cli.chat",
}

PACKAGES = {
    "model": '"""The model, knowing nothing of sharding: its config, the architecture table every consumer reads,\n'
    "the kernels every layer shares, the dense twin, and transformers as the reference.\n\n"
    "May import: errors, weights (to read tensors; weights imports only model.config back). Nothing that\n"
    'shards or runs a job."""\n',
    "weights": '"""Where weights and tokenizers come from: model paths and the WeightSource protocol, safetensors\n'
    "directories, GGUF files (per-slice dequantization), the tokenizer and chat template.\n\n"
    'May import: errors, model.config. Never anything that runs a job."""\n',
    "structural": '"""The structural mode: the plan (who owns which coordinates, as data), the sharded operators,\n'
    "one worker's sharded model and its serve loop, the client's side of a step, the control words, and\n"
    "the Megatron-style baseline (the forbidden layout, for the benchmark and the audit's negative control).\n\n"
    "May import: model, weights, comm, errors, runtime (the client is an engine; the worker process uses\n"
    "its faults and progress), audit (a worker writes its audit log), masked (the worker process serves\n"
    'the mode the client names). masked/ is its sibling."""\n',
    "runtime": '"""A job on the client\'s side, common to both modes: options and their checks, the engine (start-up,\n'
    "links, epochs, close), membership changes (recovery, revocation, standbys), local worker processes,\n"
    "topology files, fault injection for the tests, start-up progress.\n\n"
    'May import: model, weights, comm, errors. Never structural, masked, generation, serving or cli."""\n',
    "generation": '"""Generation on top of an engine: sampling values and the sampler, the generation loop, and\n'
    "continuous batching (several sessions in one sharded step).\n\n"
    'May import: runtime, model, weights, errors. Never serving or cli."""\n',
    "serving": '"""`fusion serve`\'s server: the transport-free gateway, the engine\'s scheduler thread, the\n'
    "OpenAI-compatible routes on FastAPI, their request and response models, the HTTP limits and the\n"
    "admin endpoints.\n\n"
    "May import: generation, runtime, structural, masked, weights, comm, errors, and cli.options (an engine\n"
    'assembled from flags). Nothing imports serving but cli."""\n',
    "cli": '"""The `fusion` command: the parser and its subcommands (generate, plan, worker, keys; serve, chat,\n'
    "audit, bench register themselves), and the flags every subcommand shares.\n\n"
    'Top of the tree: only `__main__` imports cli.main; other packages may import cli.options only."""\n',
}


def old_modules() -> dict[str, Path]:
    """Every module of the old layout: dotted name -> file."""
    out = {}
    for p in (ROOT / PKG).rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def new_name(old: str) -> str:
    """fusion_compute.X[.rest] -> its new dotted name (unchanged unless X moved)."""
    parts = old.split(".")
    if len(parts) >= 2 and parts[0] == PKG and parts[1] in MOVES:
        return ".".join([PKG, *MOVES[parts[1]].split("."), *parts[2:]])
    return old


def resolve(cur: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = cur.split(".") if is_pkg else cur.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def relative(cur_new: str, cur_is_pkg: bool, target: str) -> str:
    """The relative spelling of `target` from module `cur_new`."""
    here = cur_new.split(".") if cur_is_pkg else cur_new.split(".")[:-1]
    there = target.split(".")
    common = 0
    while common < min(len(here), len(there)) and here[common] == there[common]:
        common += 1
    dots = "." * (len(here) - common + 1)
    return dots + ".".join(there[common:])


HEADER = re.compile(r"from\s+[.\w]*\s+import\s")


def rewrite_imports(text: str, cur_old: str | None, is_pkg: bool, mods: dict[str, Path]) -> str:
    """Re-emit every `from X import` of a file for the new layout (cur_old None: a test, absolute)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        # Inside the package only relative imports are re-emitted here, in the tests only `from
        # fusion_compute import <modules>`: every other absolute name is rewrite_names's (never both).
        if cur_old is not None and not node.level:
            continue
        if cur_old is None and node.module != PKG:
            continue
        target = resolve(cur_old, is_pkg, node) if cur_old is not None else PKG
        if (
            target in mods
            and mods[target].name == "__init__.py"
            and all(f"{target}.{a.name}" in mods for a in node.names)
        ):
            moved = {new_name(f"{target}.{a.name}").rsplit(".", 1)[0] for a in node.names}
            if any(new_name(f"{target}.{a.name}").rsplit(".", 1)[1] != a.name for a in node.names) or len(moved) != 1:
                raise SystemExit(f"{cur_old}: cannot rewrite 'from {target} import {[a.name for a in node.names]}'")
            new_target = moved.pop()
        else:
            new_target = new_name(target)
        if cur_old is not None:
            spec = relative(new_name(cur_old), is_pkg, new_target)
        else:
            spec = new_target
        start = offsets[node.lineno - 1] + node.col_offset
        m = HEADER.match(text, start)
        if m is None:
            raise SystemExit(f"{cur_old}: unexpected import at line {node.lineno}")
        edits.append((start, m.end(), f"from {spec} import "))
    for a, b, new in sorted(edits, reverse=True):
        text = text[:a] + new + text[b:]
    return text


DOTTED = re.compile(rf"\b{PKG}\.({'|'.join(sorted(MOVES, key=len, reverse=True))})(?![\w])")
PATH = re.compile(rf"\b{PKG}/({'|'.join(sorted(MOVES, key=len, reverse=True))})\.py\b")


def rewrite_names(text: str) -> str:
    text = DOTTED.sub(lambda m: f"{PKG}.{MOVES[m.group(1)]}", text)
    return PATH.sub(lambda m: f"{PKG}/{MOVES[m.group(1)].replace('.', '/')}.py", text)


def regroup_readme_table(text: str) -> str:
    """README's module table: the moved modules' rows under a header row per new package, in
    PACKAGES' order, before the packages that already existed (comm/, audit/, ...)."""
    start = text.index("| file | what |")
    first_pkg_row = text.index("| **`comm/`** |", start)
    head, rows_text = text[:start], text[start:first_pkg_row]
    rows = rows_text.splitlines(keepends=True)
    table_head, body = rows[:2], rows[2:]
    top, grouped = [], {pkg: [] for pkg in PACKAGES}
    for row in body:
        m = re.match(r"\| `(\w+)\.py` \|", row)
        if m and m.group(1) in MOVES:
            pkg, mod = MOVES[m.group(1)].split(".")
            grouped[pkg].append(row.replace(f"`{m.group(1)}.py`", f"`{pkg}/{mod}.py`", 1))
        else:
            top.append(row)
    out = table_head + top
    for pkg, pkg_rows in grouped.items():
        doc = PACKAGES[pkg].strip('"\n').split("\n\n")[0].replace("\n", " ")
        out += [f"| **`{pkg}/`** | |\n", f"| `{pkg}/__init__.py` | {doc} |\n", *pkg_rows]
    return head + "".join(out) + text[first_pkg_row:]


def main() -> int:
    dry = "--dry-run" in sys.argv
    mods = old_modules()
    if all(f"{PKG}.{m}" not in mods for m in MOVES if m not in ("weights", "cli")) and (ROOT / PKG / "cli").is_dir():
        print("already moved: nothing to do")
        return 0
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    changed = 0
    for rel in tracked + untracked:
        p = ROOT / rel
        if (
            p.suffix not in (".py", ".md", ".toml", ".sh", ".txt")
            or rel == "scripts/codemod_packages.py"
            or not p.exists()
        ):
            continue
        text = p.read_text()
        new = text
        if rel == "README.md":
            new = regroup_readme_table(new)
        # every dotted name and path first, then the imports that spelling cannot reach (relative ones,
        # and a test's `from fusion_compute import <module>`, whose new parent may itself be a moved
        # name such as `cli`: rewritten after, it would be rewritten twice)
        new = rewrite_names(new)
        if p.suffix == ".py":
            if rel.startswith(PKG + "/"):
                parts = Path(rel).with_suffix("").parts
                cur = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                new = rewrite_imports(new, cur, parts[-1] == "__init__", mods)
            else:
                new = rewrite_imports(new, None, False, mods)
        if new != text:
            changed += 1
            if not dry:
                p.write_text(new)
    print(f"rewrote {changed} files")
    if dry:
        return 0
    for pkg in PACKAGES:
        (ROOT / PKG / pkg).mkdir(exist_ok=True)
    for old, new in MOVES.items():
        src = ROOT / PKG / f"{old}.py"
        dst = ROOT / PKG / (new.replace(".", "/") + ".py")
        subprocess.run(["git", "mv", str(src), str(dst)], cwd=ROOT, check=True)
    for pkg, doc in PACKAGES.items():
        init = ROOT / PKG / pkg / "__init__.py"
        init.write_text(doc)
        subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
    print(f"moved {len(MOVES)} modules into {len(PACKAGES)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
