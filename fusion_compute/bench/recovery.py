"""Measure recovery: how long a lost worker takes to notice, to replace, and to replay, and whether the
output is the same as without the fault. `python -m fusion_compute.bench.recovery [--out DIR]`.

One trial: a fresh job (N workers plus one standby, local processes), a prompt of L random tokens,
greedy decoding; after the 5th new token the first worker gets SIGKILL (dies: its links close) or
SIGSTOP (freezes: only the missing heartbeat tells). The engine records when it noticed, how long the
new epoch took (rendezvous, links, weights of the standby) and how long the replay of the session's
L + 5 tokens took; the tokens are compared with a run of the same prompt without a fault.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch


def trial(model: str, n: int, prompt: list[int], fault: str, new_tokens: int, liveness_s: float) -> dict:
    from ..generation.generate import generate
    from ..generation.sampling_params import SamplingParams
    from ..structural.client import Engine, EngineOptions

    opts = EngineOptions(
        n_workers=n, standby=1, context=len(prompt) + new_tokens + 8, liveness_s=liveness_s, log=lambda line: None
    )
    with Engine(model, opts) as eng:
        if eng.procs is None:
            raise RuntimeError("the recovery bench kills a worker it spawned: this engine spawned none")
        victim, when = eng.procs.pids[0], list[float]()
        tokens_seen = 0

        def on_token(_tok: int) -> None:
            nonlocal tokens_seen
            if len(when) == 0 and tokens_seen == 4:
                when.append(time.time())
                os.kill(victim, getattr(signal, fault))
            tokens_seen += 1

        t0 = time.perf_counter()
        res = generate(eng, prompt, max_new_tokens=new_tokens, sampling=SamplingParams(), on_token=on_token)
        wall = time.perf_counter() - t0
        if fault == "SIGSTOP":
            os.kill(victim, signal.SIGCONT)  # it finds itself removed and leaves
    rec = res.recoveries[0] if res.recoveries else {}
    return {
        "fault": fault,
        "context": len(prompt),
        "tokens": res.token_ids,
        "wall_s": wall,
        "detect_s": rec.get("noticed_unix", float("nan")) - when[0] if when and rec else None,
        "epoch_s": rec.get("epoch_s"),
        "replay_s": rec.get("replay_s"),
        "recovered": bool(rec),
    }


def reference(model: str, n: int, prompt: list[int], new_tokens: int) -> list[int]:
    from ..generation.generate import generate
    from ..generation.sampling_params import SamplingParams
    from ..structural.client import Engine, EngineOptions

    with Engine(model, EngineOptions(n_workers=n, context=len(prompt) + new_tokens + 8, log=lambda line: None)) as eng:
        return generate(eng, prompt, max_new_tokens=new_tokens, sampling=SamplingParams()).token_ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.recovery")
    p.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--contexts", default="32,128,512", help="prompt lengths (the tokens a recovery replays)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--liveness", type=float, default=5.0)
    p.add_argument("--out", default="out/recovery")
    a = p.parse_args(argv)
    from ..weights.loader import resolve_model_path

    model = str(resolve_model_path(a.model))
    torch.manual_seed(0)
    rows, trials = [], []
    for length in [int(x) for x in a.contexts.split(",")]:
        prompt = torch.randint(10, 20000, (length,)).tolist()
        want = reference(model, a.workers, prompt, a.new_tokens)
        for fault in ("SIGKILL", "SIGSTOP"):
            got = [trial(model, a.workers, prompt, fault, a.new_tokens, a.liveness) for _ in range(a.repeats)]
            for g in got:
                g["identical"] = g["tokens"] == want
                print(
                    f"{fault} context {length}: detect {g['detect_s']:.2f} s, epoch {g['epoch_s']} s, "
                    f"replay {g['replay_s']} s, identical {g['identical']}",
                    file=sys.stderr,
                    flush=True,
                )
            trials += got

            def med(key: str, got: list[dict] = got) -> str:
                vals = [g[key] for g in got if g[key] is not None]
                return f"{statistics.median(vals):.2f} ({min(vals):.2f}..{max(vals):.2f})" if vals else "-"

            rows.append(
                f"| {fault} | {length} | {med('detect_s')} | {med('epoch_s')} | {med('replay_s')} | "
                f"{sum(g['identical'] for g in got)}/{len(got)} |"
            )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps(trials, indent=2))
    table = "\n".join(
        [
            f"model {Path(model).name}, {a.workers} workers + 1 standby, liveness {a.liveness} s, fault after the 5th new "
            f"token, medians (min..max) of {a.repeats} trials",
            "",
            "| fault | context (tokens replayed, + 5) | detection s | new epoch s | replay s | identical output |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    (out / "recovery.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
