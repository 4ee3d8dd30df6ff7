"""A worker's linear at a few columns: W @ x against the token-major (xᵀ Wᵀ)ᵀ, timed on this CPU.

    python -m fusion_compute.bench.linear_forms [--repeats 15] [--layers 30] [--columns 1,2,3,4,5,6,8]

model/kernels.linear_fm picks the token-major form for the widths in TOKEN_MAJOR_COLUMNS on a CPU;
this measures why. One worker's shares of SmolLM2-135M at N = 2 (random fp32 weights of those
shapes: q/k/v 481 x 576 with the Σx² row, gate/up 1537 x 576, o 288 x 288, down 576 x 768), one
set per layer so that, as in the model, they do not stay in the caches; each form runs every layer's
four products for a feature-major x of T columns, the forms in a shuffled order per repeat, on one
thread. Prints one JSON line: per T, each form's median ms for the whole model, and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

SHAPES = ((481, 576), (1537, 576), (288, 288), (576, 768))


def main(argv: list[str] | None = None) -> int:
    import torch

    from ..model.kernels import token_major

    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.linear_forms", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--columns", default="1,2,3,4,5,6,8", help="the widths T, comma-separated")
    a = p.parse_args(argv)
    try:
        widths = [int(t) for t in a.columns.split(",")]
    except ValueError:
        widths = []
    if a.repeats < 1 or a.layers < 1 or not widths or min(widths) < 1:
        print(
            "bench.linear_forms: --repeats, --layers and every --columns width must be positive integers",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    forms = {
        "w_at_x": lambda w, x: w @ x,
        "token_major": token_major,
    }
    weights = [[torch.randn(*s) for s in SHAPES] for _ in range(a.layers)]
    ms: dict[str, dict[str, list[float]]] = {str(t): {f: [] for f in forms} for t in widths}
    for r in range(a.repeats):
        for t in widths:
            xs = [torch.randn(s[1], t) for s in SHAPES]
            order = list(forms)
            random.Random(r * 1000 + t).shuffle(order)
            for name in order:
                form = forms[name]
                t0 = time.perf_counter()
                for layer in weights:
                    for w, x in zip(layer, xs, strict=True):
                        form(w, x)
                ms[str(t)][name].append((time.perf_counter() - t0) * 1e3)
    out = {t: {f: round(statistics.median(v), 2) for f, v in by.items()} for t, by in ms.items()}
    print(json.dumps({"median_ms": out, "load_average_1min": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
