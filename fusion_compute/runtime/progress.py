"""Start-up progress and the start-up log: weight loading across workers, who holds what share.

Everything here writes to stderr (stdout stays clean for `--json`), and bars are drawn only when
the stream is a terminal: piped or redirected output gets no bars and no control codes.

How loading progress travels. A worker measures it where the bytes are read: `CountingSource`
wraps its weight reader and counts the elements its slices return, against what the plan says it
will hold. A worker spawned by a local client prints `@fusion-progress PHASE DONE TOTAL` lines into
its log file (`--progress lines`); the client's `LoadMonitor` reads those files (pread, so the
worker's file offset is untouched) and draws one bar per worker. A worker started by hand on
another host (`fusion worker --topology ...`) draws its own bar on its own terminal instead.
Progress lines carry counts and phase names only, never data.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

PREFIX = "@fusion-progress"
PHASES = ("start", "open", "join", "load", "ready")
_PHASE_TEXT = {
    "start": "starting",
    "open": "opening model",
    "join": "joining the client",
    "load": "loading weights",
    "ready": "ready",
}
_BAR = 24
MIB = 1 << 20


def is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _bar(frac: float, width: int = _BAR) -> str:
    frac = min(1.0, max(0.0, frac))
    full = int(frac * width)
    return "#" * full + "-" * (width - full)


# ---- worker side ----


class WorkerReporter:
    """A worker's own progress: `lines` (for the local client to read), `bar` (its own terminal) or off."""

    def __init__(self, mode: str, stream: IO[str] | None = None, label: str = "worker"):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if is_tty(self.stream) else "off"
        if mode not in ("lines", "bar", "off"):
            raise ValueError(f"progress mode must be auto, lines, bar or off, got {mode!r}")
        self.mode = mode
        self.label = label
        self._last: tuple[str | None, int] = (None, -1)  # (phase, percent) last drawn
        self._t = 0.0
        self._open = False  # a bar is drawn on the current line (no newline after it yet)

    def phase(self, phase: str, done: int = 0, total: int = 0) -> None:
        if self.mode == "off":
            return
        pct = int(100 * done / total) if total else 0
        now = time.monotonic()
        final = phase != "load" or done >= total
        # Throttle: one line per percent (and at most 10 bar redraws a second).
        if (phase, pct) == self._last or (self.mode == "bar" and not final and now - self._t < 0.1):
            return
        self._last, self._t = (phase, pct), now
        if self.mode == "lines":
            self.stream.write(f"{PREFIX} {phase} {done} {total}\n")
        else:
            size = f"  {done * 4 / MIB:.1f}/{total * 4 / MIB:.1f} MiB" if total else ""
            end = "\n" if phase == "ready" else ""
            self.stream.write(
                f"\r\x1b[2K{self.label}: {_PHASE_TEXT.get(phase, phase):<18} [{_bar(pct / 100)}] {pct:3d}%{size}{end}"
            )
            self._open = not end
        self.stream.flush()

    def end_line(self) -> None:
        """Before a log line on the same terminal: end the bar's line, so the log starts on its own."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


class CountingSource:
    """A weight source that reports how many elements of its slices it has read so far.

    `total` is what the plan says this worker holds (fp32 elements); norms and biases are read
    whole and then cut, so the count may pass the total slightly: it is clamped."""

    def __init__(self, src: Any, total: int, on_progress: Callable[[int, int], None]):
        self._src = src
        self.total = max(1, total)
        self.done = 0
        self._on_progress = on_progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self._src, name)

    def read(self, name: str, rows: Any = None, cols: Any = None) -> Any:
        t = self._src.read(name, rows=rows, cols=cols)
        self.done = min(self.total, self.done + t.numel())
        self._on_progress(self.done, self.total)
        return t


def worker_elements(plan: Any, w: int) -> int:
    """fp32 weight elements worker w (0-based; rank w + 1) reads, all layers: a structural plan's
    (plan.loaded_elements: every layer's slices less layer 0's q/k/v, which the client computes), or
    a masked plan's member's rows (masked/plan.py)."""
    if hasattr(plan, "group_of"):  # masked.plan.MaskedPlan
        return plan.weight_elements(*plan.group_of(w + 1))
    return plan.loaded_elements(w)


# ---- client side ----


def parse_progress(text: str) -> tuple[str, int, int] | None:
    """The last progress line in a worker's log text: (phase, done, total)."""
    for line in reversed(text.splitlines()):
        if line.startswith(PREFIX + " "):
            parts = line.split()
            if len(parts) == 4 and parts[1] in PHASES and parts[2].isdigit() and parts[3].isdigit():
                return parts[1], int(parts[2]), int(parts[3])
    return None


class LoadMonitor:
    """Bars for the workers' start-up, drawn on a terminal while the client waits for them.

    Local workers: one bar each, read from their log files. Remote workers: one waiting line
    (their progress is on their own terminals)."""

    def __init__(self, stream: IO[str], procs: Any, plan: Any, master: str | None = None):
        self.stream = stream
        self.procs = procs
        self.plan = plan
        self.master = master
        self.n = plan.n
        self.t0 = time.monotonic()
        self._drawn = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fusion-load-progress")
        self._thread.start()

    def _state(self) -> list[tuple[str, int, int]]:
        out = []
        for w in range(self.n):
            total = worker_elements(self.plan, w)
            st = None
            if self.procs is not None and w < len(self.procs.logs):
                try:
                    st = parse_progress(self.procs.output_tail(w, 4096))
                except (OSError, ValueError):
                    st = None
            phase, done, _ = st or ("start", 0, total)
            out.append((phase, min(done, total), total))  # the plan's total: also before loading starts
        return out

    def _lines(self, final: bool) -> list[str]:
        elapsed = time.monotonic() - self.t0
        if self.procs is None:
            state = (
                "ready"
                if final
                else f"waiting for {self.n} worker{'s' if self.n != 1 else ''} at {self.master} ({elapsed:.0f} s)"
            )
            return [f"fusion: {state}" + ("" if final else "; their progress shows on their own terminals")]
        lines = []
        for w, (phase, done, total) in enumerate(self._state()):
            if final:
                phase, done = "ready", total
            frac = done / total if total else 0.0
            lines.append(
                f"  worker {w + 1}  {_PHASE_TEXT[phase]:<18} [{_bar(frac)}] {int(100 * frac):3d}%"
                f"  {done * 4 / MIB:6.1f}/{total * 4 / MIB:.1f} MiB"
            )
        return lines

    def _draw(self, final: bool = False) -> None:
        lines = self._lines(final)
        out = [f"\x1b[{self._drawn}F"] if self._drawn else []
        out += [f"\x1b[2K{ln}\n" for ln in lines]
        self.stream.write("".join(out))
        self.stream.flush()
        self._drawn = len(lines)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._draw()
            except (OSError, ValueError):
                return

    def close(self, ok: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        try:
            if ok:
                self._draw(final=True)
        except (OSError, ValueError):
            pass


def load_monitor(stream: IO[str] = sys.stderr) -> Callable[[Any, Any], Any] | None:
    """An `EngineOptions.progress` factory when `stream` is a terminal, else None (quiet)."""
    if not is_tty(stream):
        return None

    def start(procs: Any, plan: Any, master: str | None = None) -> LoadMonitor:
        return LoadMonitor(stream, procs, plan, master)

    return start


# ---- the start-up log ----


def _ranges_text(span: tuple[int, int], total: int) -> str:
    a, b = span
    return f"[{a}, {b}) {100 * (b - a) / total:.0f}%"


def _attention_text(share: Any, head_dim: int) -> tuple[str, int]:
    """Which KV groups (and, for split groups, which RoPE pairs) a worker owns; its K (or V) dims."""
    parts, dims = [], 0
    half = head_dim // 2
    for b in share.attention:
        g = f"group {b.g0}" if b.n_groups == 1 else f"groups {b.g0}-{b.g1 - 1}"
        parts.append(g + (f" pairs [{b.p0}, {b.p1}) of {half}" if b.split else ""))
        dims += b.n_groups * b.dims
    return (", ".join(parts) or "none"), dims


LINKS = {
    "tls": "TLS 1.3, every worker authenticated by its pinned key, every byte encrypted",
    "tcp": "PLAINTEXT TCP (--insecure): readable by anyone on the path, workers unauthenticated",
    "gloo": "client links TLS; worker-to-worker on torch.distributed gloo, PLAINTEXT (--insecure)",
    "nccl": "client links TLS; worker-to-worker on NCCL (plaintext, trusted GPU fabric)",
}


def _masked_lines(engine: Any, topology: Any) -> list[str]:
    """The masked mode's start-up log: which group each worker is in, what it holds, its memory."""
    plan = engine.plan
    info = {i["rank"]: i for i in getattr(engine, "worker_info", [])}
    pids = engine.procs.pids if getattr(engine, "procs", None) is not None else []
    masks = ", ".join(f"{g} ({len(plan.ranks(g))})" for g in plan.mask_groups)
    lines = [
        f"fusion: masked plan {plan.fingerprint()}: group A ({len(plan.ranks('A'))}) multiplies one-time-pad-masked "
        f"inputs, mask group{'s' if len(plan.mask_groups) > 1 else ''} {masks} "
        f"multipl{'y' if len(plan.mask_groups) > 1 else 'ies'} the masks; the client does "
        "every nonlinear step and keeps the KV cache"
    ]
    opts = getattr(engine, "opts", None)
    if opts is not None:
        lines.append(f"fusion: links: {LINKS.get(opts.comm_backend, opts.comm_backend)}")
    for rank in range(1, plan.n + 1):
        g, m = plan.group_of(rank)
        where = f"pid {pids[rank - 1]}" if rank - 1 < len(pids) else "remote"
        if topology is not None:
            p = topology.participant(rank)
            where = f"{p.name + ' ' if p.name else ''}{p.host}" + (f", key {p.key.fingerprint}" if p.key else "")
        i = info.get(rank, {})
        rss = f"{i['peak_rss_mb']:.0f} MiB" if "peak_rss_mb" in i else "?"
        load = f"{i['load_s']:.1f} s" if "load_s" in i else "?"
        lines.append(
            f"  worker {rank} ({where}): group {g} member {m}, weight rows {worker_elements(plan, rank - 1) * 4 / MIB:.1f} "
            f"MiB as read, peak RSS {rss}, loaded in {load}"
        )
    lines.append("  client (this process): tokenizer, embedding, norms, LM head, KV cache, sampling, product checks")
    return lines


def startup_lines(engine: Any, topology: Any = None) -> list[str]:
    """Who holds what share and how much memory each worker uses, one line per worker."""
    plan, c = engine.plan, engine.config
    head = (
        f"fusion: model {engine.model_path.name} ({c.arch}, {c.n_layers} layers, hidden {c.hidden}, "
        f"{c.n_heads} heads / {c.n_kv_heads} KV heads), context {engine.context} tokens per session"
    )
    if hasattr(plan, "group_of"):  # masked.plan.MaskedPlan
        return [head, *_masked_lines(engine, topology)]
    info = {i["rank"]: i for i in getattr(engine, "worker_info", [])}
    pids = engine.procs.pids if getattr(engine, "procs", None) is not None else []
    kv_total = c.n_kv_heads * c.head_dim
    lines = [
        head,
        f"fusion: plan {plan.fingerprint()}: {plan.n} worker{'s' if plan.n != 1 else ''}"
        + (
            ", no worker holds the residual, q/k/v, MLP activations or KV cache whole"
            if plan.n > 1
            else " (N = 1 holds everything: nothing is split)"
        ),
    ]
    opts = getattr(engine, "opts", None)
    if opts is not None:
        lines.append(f"fusion: links: {LINKS.get(opts.comm_backend, opts.comm_backend)}")
    for s in plan.workers:
        where = f"pid {pids[s.worker]}" if s.worker < len(pids) else "remote"
        if topology is not None:
            p = topology.participant(s.rank)
            where = f"{p.name + ' ' if p.name else ''}{p.host}" + (f", key {p.key.fingerprint}" if p.key else "")
        attn, kv_dims = _attention_text(s, c.head_dim)
        weights = worker_elements(plan, s.worker) * 4 / MIB
        kv = 2 * c.n_layers * engine.context * kv_dims * 4 / MIB
        i = info.get(s.rank, {})
        rss = f"{i['peak_rss_mb']:.0f} MiB" if "peak_rss_mb" in i else "?"
        load = f"{i['load_s']:.1f} s" if "load_s" in i else "?"
        lines.append(
            f"  worker {s.rank} ({where}, capacity {s.capacity:g}): residual {_ranges_text(s.residual, c.hidden)}, "
            f"attention {attn} ({100 * kv_dims / kv_total:.0f}% of KV), MLP {_ranges_text(s.mlp, c.intermediate)}; "
            f"weights {weights:.1f} MiB, KV cache {kv:.1f} MiB, peak RSS {rss}, loaded in {load}"
        )
    client_mb = engine.embed.numel() * engine.embed.element_size() / MIB
    if engine.lm_head is not engine.embed:
        client_mb += engine.lm_head.numel() * engine.lm_head.element_size() / MIB
    lines.append(
        f"  client (this process): tokenizer, embedding, final norm, LM head {client_mb:.1f} MiB, "
        f"layer 0's q/k/v {_qkv0_bytes(engine) / MIB:.1f} MiB (it computes them for the ingress), sampling"
    )
    return lines


def _qkv0_bytes(engine: Any) -> int:
    """The client's copy of layer 0's q/k/v weights and bias, every worker's rows (structural
    client.layer0_qkv: the plan's boundary), in the bytes they take where they were placed."""
    tensors = [t for pair in getattr(engine, "qkv0", ()) for t in pair if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def log_startup(engine: Any, stream: IO[str] = sys.stderr, topology: Any = None) -> None:
    stream.write("\n".join(startup_lines(engine, topology)) + "\n")
    stream.flush()


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """ "1 worker", "3 workers", "0 tokens": a count with its noun in the number it takes."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
