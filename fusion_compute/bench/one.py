"""Measure one system in this process and print one JSON line (run by bench/run.py in a fresh
subprocess per system and repeat, so peak RSS and warm caches belong to that system alone).

Same workload for every system: greedy decode of `decode_tokens` after a short prompt (EOS
ignored: ids are fed back whatever they are), and prefill of random prompts of each length.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queued work (a no-op on the CPU), so a time covers the computation."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_transformers(model: str, a: argparse.Namespace) -> dict:
    from ..model.reference import load_reference
    from ..runtime.placement import torch_dtype
    from ..weights.loader import resolve_model_path

    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    # the speed comparison runs transformers as users do (eager PyTorch), in the same dtype and on the same device
    ref = load_reference(resolve_model_path(model), torch_dtype(a.dtype)).to(device)
    vocab = ref.config.vocab_size
    out: dict = {"system": "transformers", "workers": 1}

    @torch.no_grad()
    def prefill(ids: list[int]):
        res = ref(torch.tensor([ids], device=device), use_cache=True)
        _sync(device)
        return res

    prefill(_prompt(8, vocab, 1))  # warm-up: the GPU's kernels and allocator (one short prompt)
    for n in a.prompts:
        ids = _prompt(n, vocab, n)
        t = time.perf_counter()
        prefill(ids)
        out[f"prefill_{n}_s"] = time.perf_counter() - t
    ids = _prompt(a.decode_prompt, vocab, 7)
    t0 = time.perf_counter()
    res = prefill(ids)
    tok = int(res.logits[0, -1].argmax())
    out["ttft_s"] = time.perf_counter() - t0
    cache = res.cache
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(a.decode_tokens):
            res = ref(torch.tensor([[tok]], device=device), cache=cache, use_cache=True)
            cache = res.cache
            tok = int(res.logits[0, -1].argmax())
    out["decode_s"] = time.perf_counter() - t
    out["peak_rss_mb"] = {"client": round(_rss_mb(), 1)}
    return out


def measure_rtt(a: argparse.Namespace) -> dict:
    """The raw TCP round trip on loopback: 8 bytes there and back between two processes, blocking
    sockets, TCP_NODELAY: the floor any engine's per-collective latency is compared with."""
    import os
    import socket

    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]
    n = 5000
    pid = os.fork()
    if pid == 0:  # the echoing peer
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            s.sendall(s.recv(8))
        os._exit(0)
    s, _ = lst.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        s.sendall(b"12345678")
        got = 0
        while got < 8:
            got += len(s.recv(8 - got))
        times.append(time.perf_counter_ns() - t0)
    os.waitpid(pid, 0)
    times = sorted(times[n // 10 :])
    return {"system": "tcp-rtt", "workers": 2, "rtt_us": times[len(times) // 2] / 1000}


def measure_engine(model: str, a: argparse.Namespace) -> dict:
    from ..audit import netcount
    from ..generation.generate import generate
    from ..generation.sampling_params import SamplingParams
    from ..runtime.placement import itemsize
    from ..structural.client import Engine, EngineOptions
    from .ops import bench_collective, stats

    # The client embeds and runs the LM head while the workers wait, and waits while they compute:
    # the two never overlap, so it gets the whole budget, as `fusion generate` gives it by default.
    torch.set_num_threads(a.client_threads)
    extra = ("--variant", "megatron") if a.system == "megatron-tp" else ()
    ctx = max(max(a.prompts), a.decode_prompt + a.decode_tokens) + 8
    opts = EngineOptions(
        n_workers=a.workers,
        context=ctx,
        threads=a.threads,
        extra_worker_args=extra,
        comm_backend=a.comm_backend,
        insecure=a.comm_backend in ("tcp", "gloo"),
        device=a.device,
        dtype=a.dtype,
        log=lambda line: None,
    )
    out: dict = {"system": a.system, "workers": a.workers, "engine": a.comm_backend}
    with Engine(model, opts) as eng:
        vocab = eng.config.vocab
        eng.reset()
        eng.forward(_prompt(8, vocab, 1))  # warm-up, as transformers' (logits come back to the host: synced)
        for n in a.prompts:
            eng.reset()
            ids = _prompt(n, vocab, n)
            t = time.perf_counter()
            eng.forward(ids)
            out[f"prefill_{n}_s"] = time.perf_counter() - t
        ids = _prompt(a.decode_prompt, vocab, 7)
        before = stats(eng)
        pids = eng.procs.pids if eng.procs is not None else []
        sockets = netcount.available() and pids
        at: dict = {}

        def on_token(_tok: int) -> None:  # the measurements' boundaries: the first token, the last one
            at["n"] = at.get("n", 0) + 1
            if at["n"] == 1:
                out["ttft_s"] = time.perf_counter() - t0
                at["mid"] = stats(eng)
                if sockets:
                    netcount.settle(0.1)
                    at["s0"] = netcount.sample(pids, eng.watch.endpoints())
                at["t"] = time.perf_counter()
            elif at["n"] == a.decode_tokens + 1:
                out["decode_s"] = time.perf_counter() - at["t"]
                if sockets:  # kernel-counted bytes each worker put on its sockets per decode token (all peers)
                    netcount.settle(0.1)
                    moved = netcount.delta(at["s0"], netcount.sample(pids, eng.watch.endpoints()))
                    out["wire_bytes_per_token"] = max(m["sent"] for m in moved.values()) / a.decode_tokens
                at["after"] = stats(eng)  # before the session's release: its counters are the decode's

        t0 = time.perf_counter()
        generate(eng, ids, max_new_tokens=a.decode_tokens + 1, sampling=SamplingParams(), on_token=on_token)
        mid, after = at["mid"], at["after"]
        if a.workers > 1:  # the reduce-scatter verb alone: 300 fp32 rows per peer, as in the figures
            out["collective_us"] = max(w["median_us"] for w in bench_collective(eng, 300, 2000))
        # Per decode token, per worker: collectives among workers and bytes each worker sent to
        # other workers (ingress/egress/control with the client excluded; they are listed apart).
        k = a.decode_tokens
        out["collectives_per_token"] = max(
            (w1["collectives"] - w0["collectives"]) / k for w0, w1 in zip(mid, after, strict=False)
        )
        out["bytes_per_token"] = max(
            (w1["peer_bytes_sent"] - w0["peer_bytes_sent"]) / k for w0, w1 in zip(mid, after, strict=False)
        )
        out["client_bytes_per_token"] = sum(
            (w1["client_bytes"] - w0["client_bytes"]) / k for w0, w1 in zip(mid, after, strict=False)
        )
        out["prefill_collectives"] = max(
            w1["collectives"] - w0["collectives"] for w0, w1 in zip(before, mid, strict=False)
        )
        if a.system == "fusion":
            out["plan_bytes_per_token"] = max(
                eng.plan.bytes_per_token_layer(w, itemsize(a.dtype)) * eng.config.n_layers for w in range(eng.plan.n)
            )
        out["peak_rss_mb"] = {"client": round(_rss_mb(), 1)} | {
            f"worker{w['rank']}": round(w["peak_rss_mb"], 1) for w in after
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=("transformers", "fusion", "megatron-tp", "tcp-rtt"), required=True)
    p.add_argument("--comm-backend", default="tls", help="tls | tcp | gloo | mpi (fusion and megatron-tp)")
    p.add_argument("--model", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (transformers: its process)")
    p.add_argument("--client-threads", type=int, default=1)
    p.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512])
    p.add_argument("--decode-prompt", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:K: transformers' and the workers' device")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16, for every system")
    a = p.parse_args(argv)
    if a.system == "transformers":
        res = measure_transformers(a.model, a)
    elif a.system == "tcp-rtt":
        res = measure_rtt(a)
    else:
        res = measure_engine(a.model, a)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
