"""The masked client (rank 0, trusted): every nonlinear step in the clear, every matmul on the workers.

Per layer, with x (T, H) the residual, which only the client ever holds:

  step        where      what
  norm        client     h = RMSNorm(x) · g
  qkv         A, B       masked_linear(h) + bias          (bias after unmasking: it is public)
  rope, attn  client     over the KV cache the client keeps
  o           A, B       x += masked_linear(attn)
  norm        client     h = RMSNorm(x) · g
  gate_up     A, B       masked_linear(h)
  swiglu      client     a = silu(gate) · up
  down        A, B       x += masked_linear(a)

masked_linear(x) = decode(W_fx (x_fx + r) - W_fx r): the client encodes x_fx (scale s_t its own),
sends x_fx + r to every member of A (each returns its output rows), takes W_fx r from B's stream for
this layer, subtracts in the ring and rescales (ring.py). r comes from the session's mask stream
(masks.py), label (step, layer, op), never reused, never sent.

`MaskedEngine` has the structural `Engine`'s interface (config, context, reset, forward, ping,
close), so `generate()` and the CLI drive it unchanged.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from ..comm import Event, Recorder
from ..config import ModelError
from ..dense import LINEARS, ClearParams, decoder_layer, rope_tables
from ..engine import EngineBase, EngineOptions, control_word
from ..errors import UsageError
from ..kernels import causal_mask, inv_freq_tensor, rms_norm
from . import protocol as P
from . import ring
from .masks import make_stream, new_key
from .plan import MaskedPlan, make_masked_plan

MASK_KINDS = {"chacha20": P.MASK_CHACHA20, "zero": P.MASK_ZERO}


@dataclass
class MaskedOptions(EngineOptions):
    n_a: int = 2
    n_b: int = 2
    limb_bits: int = ring.DEFAULT_LIMB_BITS
    masks: str = "chacha20"  # "zero" = NEGATIVE CONTROL (A receives x_fx in the clear)
    audit_dir: str | None = None  # every rank writes its masked audit log (and A its tap) here
    leak: str | None = None  # worker-side negative control: "a-to-b"

    def __post_init__(self) -> None:
        self.n_workers = self.n_a + self.n_b

    def check(self) -> None:
        if self.masks not in MASK_KINDS:
            raise UsageError(f"unknown mask source {self.masks!r} ({', '.join(MASK_KINDS)})")
        if self.capacities:
            raise UsageError("--capacity is not supported with --mode masked (groups split rows evenly)")
        if self.engine not in ("tls", "tcp") or self.device != "cpu":
            raise UsageError("--mode masked runs on CPU links only (no worker-to-worker collectives to put on a fabric)")
        super().check()


class Tally:
    """Comm recorder that counts bytes by (direction, group) and passes events on (audit)."""

    def __init__(self, plan: MaskedPlan, inner: list[Recorder]):
        self.group = {r: g for g in ("A", "B") for r in plan.ranks(g)}
        self.inner = inner
        self.bytes: dict[str, int] = {"to_A": 0, "from_A": 0, "to_B": 0, "from_B": 0}

    def record(self, event: Event) -> None:
        for rank, n in enumerate(event.sent):
            if n:
                self.bytes[f"to_{self.group[rank]}"] += n * event.itemsize
        for rank, n in enumerate(event.received):
            if n:
                self.bytes[f"from_{self.group[rank]}"] += n * event.itemsize
        for rec in self.inner:
            rec.record(event)


class MaskedEngine(EngineBase):
    """Client side of a masked job: the session, the masks, the KV cache, every nonlinear step."""

    mode = "masked"
    opts: MaskedOptions

    def plan_for(self, order: list[int]) -> MaskedPlan:
        groups = [self.seats[p].group for p in order]
        n_a = groups.count("A")
        if groups != ["A"] * n_a + ["B"] * (len(groups) - n_a):
            raise ModelError(f"masked epoch order must list group A before group B, got {groups}")
        return make_masked_plan(self.config, n_a, len(groups) - n_a, self.opts.limb_bits)

    def initial_group(self, pid: int) -> str:
        return "A" if pid <= self.opts.n_a else "B"

    def spare_groups(self) -> list[str | None]:
        return ["A", "B"]  # --standby K: K spares for each group

    def welcome(self) -> dict:
        return {"groups": [self.plan.n_a, self.plan.n_b]}

    def worker_args(self) -> list[str]:
        out = list(self.opts.extra_worker_args)
        if self.opts.audit_dir:
            out += ["--audit-dir", str(self.opts.audit_dir)]
        if self.opts.leak:
            out += ["--inject-leak", self.opts.leak]
        return out

    def worker_env(self, threads: int) -> dict[str, str]:
        # The ring product runs on numpy's OpenBLAS (ring.py), which sizes its thread pool at
        # import: more threads than cores spin against each other (measured: 13x the worker CPU).
        return {"OPENBLAS_NUM_THREADS": str(threads), **self.opts.worker_env}

    def prepare(self, recorder: Recorder | None) -> Recorder:
        """The client's own weights (norms, biases: public, applied here only), the session state and
        the recorder that tallies bytes per group (and writes the masked audit log)."""
        c = self.config
        self.clear = [ClearParams.read(self.src, i) for i in range(c.n_layers)]
        self.inv_freq = inv_freq_tensor(c.rope, c.head_dim)
        self.audit = None
        if self.opts.audit_dir:
            from .audit import AuditLog

            self.audit = AuditLog(self.opts.audit_dir, 0, "client", None, self.opts.n_a, self.opts.n_b)
        self.tally = Tally(self.plan, [r for r in (recorder, self.audit) if r is not None])
        self.session, self.step, self.pos = -1, 0, 0
        self.stream = None
        self._pending: list = []  # sends whose delivery is still to be waited for
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.costs: list[dict] = []  # per forward: tokens, wall_s, client_cpu_s, bytes by direction
        return self.tally

    # ---- handshake: public quantization metadata from both groups ----

    def hello(self, deadline: float) -> list[dict]:
        plan, c = self.plan, self.comm
        fp = P.fingerprint_int(plan)
        msg = control_word(P.Op.HELLO, plan.limb_bits, fp, MASK_KINDS[self.opts.masks])
        for r in range(1, plan.n + 1):
            c.send(msg, r, P.KIND_CONTROL, "hello")
        info, meta = [], {}
        for r in range(1, plan.n + 1):
            wait = max(1.0, deadline - time.monotonic())  # the workers load their weights meanwhile
            reply = c.recv(torch.zeros(P.CONTROL_LEN, dtype=torch.int64), r, P.KIND_CONTROL, "hello", wait_s=wait)
            ok, wfp, load_ms, rss_kb = (int(v) for v in reply)
            if not ok:
                raise ModelError(f"worker {r} computed a different masked plan ({wfp:x} vs {fp:x}): same model?")
            g, m = plan.group_of(r)
            rows = plan.rows_per_layer(g, m) * plan.config.n_layers
            meta[r] = c.recv(torch.empty(2, rows, dtype=torch.float64), r, P.KIND_META, "meta")
            info.append({"rank": r, "group": g, "load_s": load_ms / 1000, "peak_rss_mb": rss_kb / 1024})
        per_group = {g: self._assemble(g, meta) for g in ("A", "B")}
        # A and B must hold bit-identical fixed-point weights, or W(x + r) - W r is not W x.
        for a, b in zip(per_group["A"], per_group["B"], strict=True):
            if not torch.equal(a, b):
                raise ModelError("groups A and B quantized the weights differently: same model file on every worker?")
        self.inv_w = [[ring.inverse_scales(e[0]) for e in layer] for layer in self._by_layer(per_group["A"])]
        self.w_norm_max = [
            [float(e[1].max()) if e.shape[1] else 0.0 for e in layer] for layer in self._by_layer(per_group["A"])
        ]
        return info

    def _assemble(self, group: str, meta: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Per (layer, op), in that order: (2, rows) metadata of the whole linear, members in rank order."""
        plan = self.plan
        chunks = {r: list(meta[r].split(self._sizes(group, plan.group_of(r)[1]), dim=1)) for r in plan.ranks(group)}
        n_ops = len(plan.shapes)
        return [torch.cat([chunks[r][i] for r in plan.ranks(group)], 1) for i in range(plan.config.n_layers * n_ops)]

    def _sizes(self, group: str, member: int) -> list[int]:
        per_layer = [self.plan.n_rows(group, member, s.op) for s in self.plan.shapes]
        return per_layer * self.plan.config.n_layers

    def _by_layer(self, flat: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        n_ops = len(self.plan.shapes)
        return [flat[i : i + n_ops] for i in range(0, len(flat), n_ops)]

    # ---- sessions ----

    def _isend(self, tensor: torch.Tensor, rank: int, kind: str, op: str) -> None:
        self._pending.append(self.comm.isend(tensor, rank, kind, op))

    def _drain(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending.clear()

    def _wipe(self) -> None:
        """The session is over: the client's own KV cache (the only clear state) is zeroed now."""
        if self._kv is not None:
            self._kv[0].zero_()
            self._kv[1].zero_()

    def _reset(self) -> None:
        """A new session: a fresh mask key (to B only), a fresh step counter, a zeroed KV cache."""
        self._drain()
        self._wipe()
        self.session += 1
        self.step = self.pos = 0
        key = new_key()
        self.stream = make_stream(MASK_KINDS[self.opts.masks], key, guard=True)
        for r in self.plan.ranks("B"):
            self._isend(torch.tensor([int(P.Op.RESET), 0, 0, 0], dtype=torch.int64), r, P.KIND_CONTROL, "reset")
            self._isend(torch.tensor(list(key), dtype=torch.uint8), r, P.KIND_KEY, "key")
        if self.audit is not None:
            self.audit.session(self.session, hashlib.sha256(key).hexdigest()[:16])
        if self._kv is None:
            c = self.config
            shape = (c.n_layers, c.n_kv_heads, self.context, c.head_dim)
            self._kv = (torch.zeros(shape), torch.zeros(shape))

    def kv_abs_max(self) -> float:
        """The largest |value| left in the client's KV cache (0 after a wipe): hygiene tests."""
        return 0.0 if self._kv is None else max(float(self._kv[0].abs().max()), float(self._kv[1].abs().max()))

    # ---- one forward ----

    def _forward(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run tokens `ids` at the session's position; logits (V,) of the last token, or (T, V)."""
        t = len(ids)
        if self.stream is None:
            self._reset()
        if self.pos + t > self.context:
            raise ValueError(f"{self.pos + t} tokens exceed the context window of {self.context}")
        threads = torch.get_num_threads()
        # Hundreds of tiny ops per token: OpenMP fan-out costs more than it saves (measured: client
        # CPU per SmolLM2 token 0.4-0.8 s with 2 threads, 0.15-0.25 s with 1). Restored on return.
        torch.set_num_threads(1)
        try:
            return self._masked_step(ids, all_logits)
        finally:
            torch.set_num_threads(threads)

    def _masked_step(self, ids: list[int], all_logits: bool) -> torch.Tensor:
        t = len(ids)
        wall0, cpu0, bytes0 = time.perf_counter(), time.process_time(), dict(self.tally.bytes)
        plan, c = self.plan, self.config
        for r in plan.ranks("A"):  # A learns T, nothing else
            self._isend(torch.tensor([int(P.Op.FORWARD), t, 0, 0], dtype=torch.int64), r, P.KIND_CONTROL, "forward")
        for r in plan.ranks("B"):  # B learns T and the step (its mask labels)
            self._isend(
                torch.tensor([int(P.Op.FORWARD), t, 0, self.step], dtype=torch.int64), r, P.KIND_CONTROL, "forward"
            )
        # B streams W_fx r layer by layer: post every receive now, wait for each when it is needed.
        self._b_in = []
        for layer in range(c.n_layers):
            bufs = []
            for r in plan.ranks("B"):
                buf = torch.empty(plan.rows_per_layer("B", plan.group_of(r)[1]), t, dtype=torch.int64)
                bufs.append((self.comm.irecv(buf, r, P.KIND_OUT, P.op_name(layer, "mask")), buf))
            self._b_in.append(bufs)
        self._b_out: dict[int, list[torch.Tensor]] = {}

        x_TH = self.embed[torch.tensor(ids)]  # (T, H): the clear residual stream, client only
        cos, sin = rope_tables(self.inv_freq, torch.arange(self.pos, self.pos + t))
        mask = causal_mask(self.pos, t)
        for layer in range(c.n_layers):
            x_TH = self._layer(layer, x_TH, cos, sin, mask)
        self._drain()
        if self.audit is not None:
            self.audit.end_step()
        self.pos += t
        self.step += 1
        if not all_logits:
            x_TH = x_TH[-1:]
        logits = rms_norm(x_TH, self.final_norm, c.rms_eps) @ self.lm_head.T  # (T, V)
        self.costs.append({
            "tokens": t, "wall_s": time.perf_counter() - wall0, "client_cpu_s": time.process_time() - cpu0,
            **{k: v - bytes0[k] for k, v in self.tally.bytes.items()},
        })  # fmt: skip
        return logits if all_logits else logits[0]

    def _layer(self, i: int, x_TH: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        """dense.decoder_layer with every linear a masked product (batch of one sequence)."""
        pos, t = self.pos, x_TH.shape[0]
        k_cache, v_cache = self._kv[0][i], self._kv[1][i]  # (n_kv, S_max, d)

        def kv(k, v):
            k_cache[:, pos : pos + t] = k[0]
            v_cache[:, pos : pos + t] = v[0]
            return k_cache[None, :, : pos + t], v_cache[None, :, : pos + t]

        def linear(name: str, x: torch.Tensor) -> torch.Tensor:
            return self.masked_linear(i, LINEARS.index(name), x[0])[None]

        return decoder_layer(self.config, self.clear[i], x_TH[None], linear, kv, cos, sin, mask)[0]

    def masked_linear(self, layer: int, op: int, x_TK: torch.Tensor) -> torch.Tensor:
        """W x for x (T, K), computed by the workers on x_fx + r; returns (T, N) fp32."""
        plan = self.plan
        shape = plan.shapes[op]
        t, name = x_TK.shape[0], P.op_name(layer, shape.name)
        x_fx, s = ring.encode(x_TK.T, self.w_norm_max[layer][op])  # (K, T) int64, (T,)
        r = self.stream.draw(self.step, layer, op, shape.k * t).view(shape.k, t)
        if self.audit is not None:
            self.audit.mask(self.session, self.step, layer, op)
        m_KT = (x_fx + r).contiguous()  # wraps mod 2^64: uniform, whatever x is
        sends, outs = [], []
        for rank in plan.ranks("A"):  # every member gets the whole masked input, returns its rows
            sends.append(self.comm.isend(m_KT, rank, P.KIND_MASKED, name))
            buf = torch.empty(plan.n_rows("A", plan.group_of(rank)[1], op), t, dtype=torch.int64)
            outs.append((self.comm.irecv(buf, rank, P.KIND_OUT, name), buf))
        y_b = self._b_rows(layer, op)  # usually already here: B works ahead
        for work in sends:
            work.wait()
        for work, _ in outs:
            work.wait()
        y_a = torch.cat([buf for _, buf in outs])  # (N, T): W_fx (x_fx + r)
        y_fx = y_a - y_b  # W_fx x_fx exactly, |.| < 2^62 by the bound encode() checked
        ring.check_result(y_fx, name)
        y = ring.decode(y_fx, self.inv_w[layer][op], s)  # rescaled, float64
        return y.T.to(torch.float32)

    def _b_rows(self, layer: int, op: int) -> torch.Tensor:
        """W_fx r for (layer, op), all output rows, from B's stream (waits for the layer's message)."""
        plan = self.plan
        if layer not in self._b_out:
            per_op: list[list[torch.Tensor]] = [[] for _ in plan.shapes]
            for (work, buf), r in zip(self._b_in[layer], plan.ranks("B"), strict=True):
                work.wait()
                sizes = [plan.n_rows("B", plan.group_of(r)[1], s.op) for s in plan.shapes]
                for i, part in enumerate(buf.split(sizes)):
                    per_op[i].append(part)
            self._b_out[layer] = [torch.cat(p) for p in per_op]
            self._b_in[layer] = []
        return self._b_out[layer][op]

    # ---- the rest of Engine's interface ----

    def ping(self) -> list[dict]:
        self._drain()
        msg = control_word(P.Op.PING)
        out = []
        for r in range(1, self.plan.n + 1):
            self.comm.send(msg, r, P.KIND_CONTROL, "ping")
            reply = self.comm.recv(torch.zeros(P.CONTROL_LEN, dtype=torch.int64), r, P.KIND_CONTROL, "pong")
            out.append({"rank": r, "group": self.plan.group_of(r)[0], "peak_rss_mb": int(reply[3]) / 1024})
        return out

    def shutdown(self) -> None:
        self._drain()
        for r in range(1, self.plan.n + 1):
            self.comm.send(control_word(P.Op.SHUTDOWN), r, P.KIND_CONTROL, "shutdown")

    def close(self) -> None:
        super().close()
        if getattr(self, "audit", None) is not None:
            self.audit.close()
