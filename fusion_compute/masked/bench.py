"""Measured costs of the masked mode next to the structural mode, on the same machine, same prompt.

  python -m fusion_compute.masked.bench [--model M] [--groups 2+2] [--workers 2] [--tokens 32]
                                        [--rounds 2] [--kernels] [--json]
  python -m fusion_compute.masked.bench --verify-cost   # the product check on vs off; 1, 2, 3 mask groups
  python -m fusion_compute.masked.bench --check-only    # the product check alone (no workers)

Per mode and round: greedy decode of the chat prompt for a fixed number of tokens (not stopping
at end-of-turn, so every round times the same steps); decode tokens/s (tokens after the first over
the time after the first, as `fusion generate` reports it), bytes per decode token sent to and
received from the workers by the client (from comm's own events), client CPU per decode token
(process time, all threads), and worker CPU per decode token (utime + stime of the local worker
processes, from /proc). Rounds alternate the modes so a noisy neighbour hurts both alike; the
summary takes each mode's best round. `--kernels` times the ring product against its alternatives.
`--verify-cost` runs the masked mode only: 1+1 with the product check off and on, then 1+1+1 and
1+1+1+1 (check on), reporting the check's own CPU per token (`check_ms_per_token`) and precompute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

QUESTION = "What is the capital of France?"


class _Bytes:
    """Comm recorder: bytes the client sent to / received from workers."""

    def __init__(self):
        self.sent = self.received = 0

    def record(self, e) -> None:
        self.sent += sum(e.sent) * e.itemsize
        self.received += sum(e.received) * e.itemsize


def run_mode(mode: str, model, ids: list[int], tokens: int, n: int, groups, verify: bool = True) -> dict:
    from ..generation.generate import generate
    from ..generation.sampling_params import SamplingParams
    from ..runtime.engine import EngineBase
    from ..runtime.resources import processes_cpu_s
    from ..structural.client import Engine, EngineOptions
    from .client import MaskedEngine, MaskedOptions

    rec = _Bytes()
    t_load = time.perf_counter()
    eng: EngineBase
    if mode == "masked":
        opts = MaskedOptions(n_a=groups[0], n_b=tuple(groups[1:]), context=512, verify=verify)
        eng = MaskedEngine(model, opts, recorder=rec)
    else:
        eng = Engine(model, EngineOptions(n_workers=n, context=512), recorder=rec)
    load_s = time.perf_counter() - t_load
    with eng:
        check = getattr(eng, "verifier", None)
        pids = eng.procs.pids if eng.procs is not None else []
        at: dict = {}

        def on_token(_tok: int) -> None:  # the measurements' boundaries: after the first token, at the last
            at["n"] = at.get("n", 0) + 1
            if at["n"] == 1:
                at["start"] = (
                    rec.sent,
                    rec.received,
                    processes_cpu_s(pids),
                    time.process_time(),
                    time.perf_counter(),
                    (check.check_s if check is not None else 0.0),
                )
            if at["n"] == tokens:
                s0, r0, w0, c0, t0, k0 = at["start"]
                at["end"] = (
                    time.perf_counter() - t0,
                    time.process_time() - c0,
                    rec.sent - s0,
                    rec.received - r0,
                    processes_cpu_s(pids) - w0,
                    check.check_s - k0 if check is not None else 0.0,
                )

        # past an end-of-turn token too: a fixed number of decode steps
        res = generate(eng, ids, max_new_tokens=tokens, sampling=SamplingParams(), on_token=on_token)
        out = res.token_ids
        wall, cpu, sent, received, workers_cpu, check_s = at["end"]
        steps = len(out) - 1
        verified = {
            "verify": check is not None,
            "check_ms_per_token": 1000 * check_s / steps if check is not None else 0.0,
            "precompute_s": check.precompute_s if check is not None else None,
            "load_s": load_s,  # engine start-up: workers spawned, joined, weights loaded (precompute overlaps)
        }
    return {
        "mode": mode,
        "workers": "+".join(map(str, groups)) if mode == "masked" else str(n),
        **verified,
        "decode_tokens": steps,
        "decode_tokens_per_s": steps / wall,
        "client_to_workers_bytes_per_token": sent / steps,
        "workers_to_client_bytes_per_token": received / steps,
        "client_cpu_ms_per_token": 1000 * cpu / steps,
        "workers_cpu_ms_per_token": 1000 * workers_cpu / steps,
        "token_ids": out,
    }


def kernels(model) -> list[dict]:
    """Time the ring product W_fx m (mod 2^64) for the model's shapes: float64 limbs (β = 13, 16, 22)
    against torch's int64 matmul (W converted per call, as `RingMatrix.matmul` does), with fp32
    W x as the yardstick. Single thread, best of N."""
    from ..weights.loader import open_weights
    from .plan import linear_shapes
    from .ring import RingMatrix, limit_blas_threads, quantize_rows, weight_bits

    torch.set_num_threads(1)
    limit_blas_threads(1)
    c = open_weights(model).config

    def best(f, n: int) -> float:
        f()
        b = float("inf")
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            b = min(b, time.perf_counter() - t0)
        return 1000 * b

    rows = []
    for s in linear_shapes(c):
        w = torch.randn(s.rows, s.k)
        for t in (1, 32, 128):
            m = torch.randint(-(2**63), 2**63 - 1, (s.k, t), dtype=torch.int64)
            x = torch.randn(s.k, t)
            row = {"linear": s.name, "shape": [s.rows, s.k], "T": t, "fp32_ms": best(lambda: w @ x, 50)}  # noqa: B023
            for beta in (13, 16, 22):
                mat = RingMatrix(quantize_rows(w, weight_bits(s.k, beta))[0], beta)
                row[f"f64_limbs_b{beta}_ms"] = best(lambda: mat.matmul_limbs(m), 20)  # noqa: B023
            row["int64_ms"] = best(lambda: mat.matmul_int64(m), 3)  # noqa: B023 (W converted per call)
            rows.append(row)
    return rows


def exactness(model, ids: list[int], limb_bits: tuple[int, ...] = (13, 16, 22), groups=(2, 2)) -> dict:
    """How far each mode is from exact (float64) arithmetic on the same weights.

    Per linear: the real inputs of every q/o/gate/down projection in a float64 transformers forward
    of `ids` (hooks); error of the fixed-point ring product (exact integer W_fx x_fx, rescaled) and
    of fp32 W x (what transformers computes), both against float64, as max |err| / rms(W x).
    End to end: prefill logits of the masked engine for each limb width, of the structural engine
    and of transformers fp32, against transformers float64."""
    from ..model.reference import load_reference
    from ..structural.client import Engine, EngineOptions
    from ..weights.loader import resolve_model_path
    from .client import MaskedEngine, MaskedOptions
    from .ring import RingMatrix, decode, encode, inverse_scales, quantize_rows, weight_bits

    path = resolve_model_path(model)
    ref32 = load_reference(path, torch.float32)
    ref64 = load_reference(path)
    inputs: dict[tuple[int, str], torch.Tensor] = {}  # (layer, linear) -> its input (T, K), row 0 of the batch
    hooks = []
    for i, layer in enumerate(ref64.model.layers):
        for name, mod in (
            ("qkv", layer.self_attn.q_proj),
            ("o", layer.self_attn.o_proj),
            ("gate_up", layer.mlp.gate_proj),
            ("down", layer.mlp.down_proj),
        ):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, key=(i, name): inputs.setdefault(key, a[0][0])))
    with torch.no_grad():
        logits64 = ref64(torch.tensor([ids])).logits[0]
        logits32 = ref32(torch.tensor([ids])).logits[0].double()
    for h in hooks:
        h.remove()
    weights = {
        "qkv": lambda L: torch.cat([L.self_attn.q_proj.weight, L.self_attn.k_proj.weight, L.self_attn.v_proj.weight]),
        "o": lambda L: L.self_attn.o_proj.weight,
        "down": lambda L: L.mlp.down_proj.weight,
        "gate_up": lambda L: torch.cat([L.mlp.gate_proj.weight, L.mlp.up_proj.weight]),
    }
    per_linear: dict[str, float] = {f"ring_b{b}": 0.0 for b in limb_bits} | {"fp32": 0.0}
    for (i, name), x64 in inputs.items():
        w64 = weights[name](ref64.model.layers[i]).detach()  # float64 copies of the fp32 weights: exact
        exact = x64 @ w64.T  # (T, N)
        rms = float(exact.pow(2).mean().sqrt())
        fp32 = (x64.float() @ w64.float().T).double()
        per_linear["fp32"] = max(per_linear["fp32"], float((fp32 - exact).abs().max()) / rms)
        for b in limb_bits:
            w_fx, e = quantize_rows(w64, weight_bits(w64.shape[1], b))
            x_fx, s = encode(x64.T.float(), float(w_fx.norm(dim=1).max()))  # the client encodes its fp32 x
            y = decode(RingMatrix(w_fx, b).matmul(x_fx), inverse_scales(e), s).T
            ref = x64.float().double() @ w64.T  # same fp32 input, exact product: isolates the ring's error
            per_linear[f"ring_b{b}"] = max(per_linear[f"ring_b{b}"], float((y - ref).abs().max()) / rms)
    errs: dict[str, float] = {}
    out: dict[str, dict[str, float] | float] = {
        "per_linear_max_err_over_rms": per_linear,
        "logits_max_abs_err_vs_float64": errs,
    }
    errs["transformers_fp32"] = float((logits32 - logits64).abs().max())
    with Engine(model, EngineOptions(n_workers=2, context=512)) as eng:
        eng.reset()
        errs["structural_N2"] = float((eng.forward(ids, all_logits=True).double() - logits64).abs().max())
    for b in limb_bits:
        with MaskedEngine(model, MaskedOptions(n_a=groups[0], n_b=tuple(groups[1:]), context=512, limb_bits=b)) as eng:
            eng.reset()
            errs[f"masked_b{b}"] = float((eng.forward(ids, all_logits=True).double() - logits64).abs().max())
    out["logits_scale_rms"] = float(logits64.pow(2).mean().sqrt())
    return out


VERIFY_CONFIGS = (((1, 1), False), ((1, 1), True), ((1, 1, 1), True), ((1, 1, 1, 1), True))


def verify_cost(model, ids: list[int], tokens: int, rounds: int) -> dict:
    """Masked mode with the product check off and on (1+1), and with 2 and 3 mask groups (check on):
    rounds alternate the configurations; each takes its best round (by decode speed)."""
    runs: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for groups, verify in VERIFY_CONFIGS:
            r = run_mode("masked", model, ids, tokens, 0, groups, verify=verify)
            r.pop("token_ids")
            runs.setdefault(f"{'+'.join(map(str, groups))} verify {'on' if verify else 'off'}", []).append(r)
            print(json.dumps(r), file=sys.stderr)
    best = {k: max(v, key=lambda r: r["decode_tokens_per_s"]) for k, v in runs.items()}
    off, on = best["1+1 verify off"], best["1+1 verify on"]
    return {
        "model": str(model),
        "cpus": os.cpu_count(),
        "runs": best,
        "client_cpu_ratio_verify_on_over_off": on["client_cpu_ms_per_token"] / off["client_cpu_ms_per_token"],
        "check_share_of_client_cpu": on["check_ms_per_token"] / on["client_cpu_ms_per_token"],
        "decode_ms_per_token_by_mask_groups": {
            k: 1000 / best[f"{s} verify on"]["decode_tokens_per_s"]
            for k, s in ((1, "1+1"), (2, "1+1+1"), (3, "1+1+1+1"))
        },
    }


def check_only(model, tokens: int = 32) -> dict:
    """The product check alone, in this process, on the model's real weights: the one-off precompute
    (U and V for every linear) and the check of every linear of `tokens` decode steps (T = 1), on
    inputs encoded as the client encodes them and their exact products. For models whose masked run
    does not fit this machine (every member of a one-member group holds all rows as float64)."""
    from ..weights.loader import open_weights
    from . import ring
    from .plan import make_masked_plan
    from .verify import ProductCheck

    torch.set_num_threads(1)  # the client's own setting (masked/client.py)
    src = open_weights(model)
    t0 = time.perf_counter()
    chk = ProductCheck(make_masked_plan(src.config, 1, (1,), ring.DEFAULT_LIMB_BITS), src)
    chk.wait()
    wall = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    cases = []
    for layer in range(src.config.n_layers):
        for s in chk.plan.shapes:
            w = chk.weights(layer, s.op, (0, s.rows))
            x_fx, _ = ring.encode(torch.randn(s.k, 1, dtype=torch.float64, generator=gen), float(w.norm(dim=1).max()))
            cases.append((layer, s.op, ring.RingMatrix(w, chk.plan.limb_bits).matmul(x_fx), x_fx))
    c0 = chk.check_s
    for _ in range(tokens):
        for layer, op, y, x_fx in cases:
            if not chk.check(layer, op, y, x_fx):
                raise AssertionError(f"an honest product failed the check at L{layer} op {op}")
    return {
        "model": str(model),
        "linears_per_token": len(cases),
        "precompute_s": round(chk.precompute_s, 3),
        "precompute_wall_s": round(wall, 3),
        "check_ms_per_token": round(1000 * (chk.check_s - c0) / tokens, 3),
        "check_us_per_linear": round(1e6 * (chk.check_s - c0) / tokens / len(cases), 1),
        "kept_mb": round(sum(lin.u.nbytes + lin.v_limbs.nbytes for lin in chk.lin.values()) / 2**20, 2),
    }


def main(argv: list[str] | None = None) -> int:
    from ..weights.loader import resolve_model_path
    from ..weights.tokenizer import load_tokenizer
    from .plan import parse_groups

    p = argparse.ArgumentParser(prog="python -m fusion_compute.masked.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--groups", default="2+2", help="masked group sizes A+B or A+B1+...+Bk")
    p.add_argument("--workers", type=int, default=2, help="structural N")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kernels", action="store_true", help="also time the ring-product kernels")
    p.add_argument("--exactness", action="store_true", help="only measure errors against float64 (no timing)")
    p.add_argument(
        "--verify-cost",
        action="store_true",
        help="the product check's cost (on vs off) and each extra mask group's, masked mode only",
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="the product check alone (precompute, CPU per decode token), no workers",
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    path = resolve_model_path(a.model)
    if a.check_only:
        print(json.dumps(check_only(path, a.tokens), indent=None if a.json else 2))
        return 0
    groups = parse_groups(a.groups)
    tok = load_tokenizer(path)
    ids = tok.chat_ids([{"role": "user", "content": QUESTION}])
    if a.exactness:
        print(json.dumps(exactness(path, ids, groups=groups), indent=2))
        return 0
    if a.verify_cost:
        print(json.dumps(verify_cost(path, ids, a.tokens, a.rounds), indent=None if a.json else 2))
        return 0
    runs = []
    for _ in range(a.rounds):
        for mode in ("structural", "masked"):
            r = run_mode(mode, path, ids, a.tokens, a.workers, groups)
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), file=sys.stderr)
    best = {
        m: max((r for r in runs if r["mode"] == m), key=lambda r: r["decode_tokens_per_s"])
        for m in ("structural", "masked")
    }
    s, m = best["structural"], best["masked"]
    summary = {
        "model": path.name,
        "cpus": os.cpu_count(),
        "structural": {k: v for k, v in s.items() if k != "token_ids"},
        "masked": {k: v for k, v in m.items() if k != "token_ids"},
        "same_tokens": s["token_ids"] == m["token_ids"],
        "decode_speed_ratio_masked_over_structural": m["decode_tokens_per_s"] / s["decode_tokens_per_s"],
        "client_bytes_ratio": (m["client_to_workers_bytes_per_token"] + m["workers_to_client_bytes_per_token"])
        / (s["client_to_workers_bytes_per_token"] + s["workers_to_client_bytes_per_token"]),
        "client_cpu_ratio": m["client_cpu_ms_per_token"] / s["client_cpu_ms_per_token"],
    }
    if a.kernels:
        summary["kernels"] = kernels(path)
    print(json.dumps(summary, indent=None if a.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
