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

masked_linear(x) = decode(W_fx (x_fx + r) - Σ_g W_fx r_g), r = Σ_g r_g: the client encodes x_fx
(scale s_t its own), sends x_fx + r to every member of A (each returns its output rows), takes
W_fx r_g from each mask group g's stream for this layer, subtracts in the ring, checks the result
(verify.py: Freivalds over the integers; a wrong product never reaches a token) and rescales
(ring.py). Each r_g comes from group g's session stream (masks.py), label (step, layer, op), never
reused, never sent: A reads nothing unless it holds a member of every mask group.

`MaskedEngine` has the structural `Engine`'s interface (config, context, reset, forward_batch,
release, ping, close), so `generate()`, the CLI and `fusion serve --max-batch` drive it unchanged: one
session is a step of one span (slot 0), several run in one masked step. A batch is the workers'
business only as a wider T: every session's new tokens are columns of the same masked
products (one round per linear for all of them), while the positions, the causal masks and the KV
caches, one per session's slot, stay on the client, which does the attention of each session apart.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import torch

from ..comm import Event, Recorder
from ..model import architecture as arch
from ..model.config import ModelError
from ..model.dense import LINEARS, ClearParams, DenseOps, DenseSpan, rotaries
from ..model.kernels import rms_norm
from ..model.layer import decoder_layer
from ..runtime.engine import EngineBase, control_word
from . import protocol as P
from . import ring
from .masks import make_stream, new_key
from .options import MASK_KINDS, MaskedOptions
from .plan import MaskedPlan, make_masked_plan, mask_group_names
from .verify import ProductCheck, ProductRejected


class Tally:
    """Comm recorder that counts bytes by (direction, group: A, or B for every mask group together)
    and passes events on (audit)."""

    def __init__(self, plan_now: Callable[[], MaskedPlan], inner: list[Recorder]):
        self.plan_now = plan_now  # the current epoch's plan: ranks change with the epoch
        self.inner = inner
        self.bytes: dict[str, int] = {"to_A": 0, "from_A": 0, "to_B": 0, "from_B": 0}

    def record(self, event: Event) -> None:
        plan = self.plan_now()
        for rank, n in enumerate(event.sent):
            if n:
                self.bytes["to_A" if plan.group_of(rank)[0] == "A" else "to_B"] += n * event.itemsize
        for rank, n in enumerate(event.received):
            if n:
                self.bytes["from_A" if plan.group_of(rank)[0] == "A" else "from_B"] += n * event.itemsize
        for rec in self.inner:
            rec.record(event)


class MaskedEngine(EngineBase):
    """Client side of a masked job: the session, the masks, the KV cache, every nonlinear step."""

    mode = "masked"
    verifies_trees = True  # the client attends in the clear: a tree's mask and depths are its own (_masked_step)
    opts: MaskedOptions
    plan: MaskedPlan  # the current epoch's (plan_for)

    def group_names(self) -> tuple[str, ...]:
        """A, then the job's mask groups (B, or B1..Bk)."""
        return ("A", *mask_group_names(len(self.opts.b_sizes)))

    def plan_for(self, order: list[int]) -> MaskedPlan:
        groups = [self.seats[p].group for p in order]
        names = self.group_names()
        sizes = tuple(groups.count(g) for g in names)
        if groups != [g for g, n in zip(names, sizes, strict=True) for _ in range(n)]:
            raise ModelError(f"masked epoch order must list the groups in the order {', '.join(names)}, got {groups}")
        limb_bits = ring.DEFAULT_LIMB_BITS if self.opts.limb_bits is None else self.opts.limb_bits
        return make_masked_plan(self.config, sizes[0], sizes[1:], limb_bits)

    def initial_group(self, pid: int) -> str:
        bound = 0
        for g, n in zip(self.group_names(), self.opts.sizes, strict=True):
            bound += n
            if pid <= bound:
                return g
        raise ModelError(f"participant {pid} is beyond the {'+'.join(map(str, self.opts.sizes))} groups")

    def spare_groups(self) -> list[str | None]:
        return list(self.group_names())  # --standby K: K spares for each group

    def welcome(self) -> dict:
        return {"groups": list(self.plan.sizes)}

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
        # the layer in the clear, every linear a masked product over all the step's rows
        self.ops = DenseOps(c, self.clear, lambda i, name, x: self.masked_linear(i, LINEARS.index(name), x[0])[None])
        self.rotary, self.rotary_local = rotaries(c)
        self.audit = None
        if self.opts.audit_dir:
            from .audit import AuditLog

            self.audit = AuditLog(self.opts.audit_dir, 0, "client", None, self.opts.sizes, verify=self.opts.verify)
        self.tally = Tally(lambda: self.plan, [r for r in (recorder, self.audit) if r is not None])
        # The check's secret vectors, computed from the client's own copy of the weights while the
        # workers load theirs.
        self.verifier = ProductCheck(self.plan, self.src) if self.opts.verify else None
        self.session, self.step = -1, 0
        self.streams: list | None = None  # one mask stream per mask group
        self._pending: list = []  # sends whose delivery is still to be waited for
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # KV slot -> the client's cache (0: one session)
        self.slot_pos: dict[int, int] = {}  # each open slot's position of its next token
        self.costs: list[dict] = []  # per forward: tokens, wall_s, client_cpu_s, bytes by direction
        return self.tally

    # ---- handshake: public quantization metadata from every group ----

    def hello(self, deadline: float, order: list[int]) -> list[dict]:
        plan, c = self.plan, self.wire
        if self.audit is not None:
            self.audit.epoch(self.epoch, plan.sizes, list(order))
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
        per_group = {g: self._assemble(g, meta) for g in plan.groups}
        # Every group must hold bit-identical fixed-point weights, or W(x + r) - Σ W r_g is not W x.
        for g in plan.mask_groups:
            for a, b in zip(per_group["A"], per_group[g], strict=True):
                if not torch.equal(a, b):
                    raise ModelError(
                        f"groups A and {g} quantized the weights differently: same model file on every worker?"
                    )
        if self.verifier is not None:  # and the client's own: what every group agrees on may still be a lie
            self.verifier.check_metadata(per_group["A"])
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
        self._pending.append(self.wire.isend(tensor, rank, kind, op))

    def _drain(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending.clear()

    def _wipe(self) -> None:
        """The session is over: the client's own KV caches (the only clear state) are zeroed now."""
        for k, v in self._kv.values():
            k.zero_()
            v.zero_()

    def _cache(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's (K, V) cache, (layers, n_kv, context, d) each, made at its first use (a batch of
        B sessions keeps up to B of them, kept and zeroed between sessions)."""
        if slot not in self._kv:
            c = self.config
            shape = (c.n_layers, c.n_kv_heads, self.context, c.head_dim)
            self._kv[slot] = (torch.zeros(shape), torch.zeros(shape))
        return self._kv[slot]

    def _reset(self) -> None:
        """A new session: a fresh mask key per mask group (to that group only), fresh check
        coefficients, a fresh step counter, a zeroed KV cache."""
        self._drain()
        self._wipe()
        self.session += 1
        self.step = 0
        self.slot_pos = {}
        keys = [new_key() for _ in self.plan.mask_groups]
        self.streams = [make_stream(MASK_KINDS[self.opts.masks], key, guard=True) for key in keys]
        for g, key in zip(self.plan.mask_groups, keys, strict=True):
            for r in self.plan.ranks(g):
                self._isend(torch.tensor([int(P.Op.RESET), 0, 0, 0], dtype=torch.int64), r, P.KIND_CONTROL, "reset")
                self._isend(torch.tensor(list(key), dtype=torch.uint8), r, P.KIND_KEY, "key")
        if self.audit is not None:
            self.audit.session(self.session, [hashlib.sha256(key).hexdigest()[:16] for key in keys])

    def _release(self, slot: int) -> None:
        """One session of a batch is over: its slot of the client's cache is zeroed now. The workers
        hold nothing of it (they see masked columns only), and the mask streams go on: a mask is
        drawn once per (step, layer, linear) whatever the sessions in the step."""
        self.slot_pos.pop(slot, None)
        if slot in self._kv:
            for t in self._kv[slot]:
                t.zero_()

    def _rollback(self, slot: int, keep: int) -> None:
        """Speculation's rejected positions: zeroed in the client's cache now (the workers hold no KV)."""
        end = self.slot_pos.get(slot, keep)
        self.slot_pos[slot] = keep
        if slot in self._kv:
            for t in self._kv[slot]:
                t[:, :, keep:end].zero_()

    def _keep(self, slot: int, base: int, path: list[int]) -> None:
        """A token tree's accepted path: its columns' entries moved to base.. in the client's cache (each
        key was rotated at base + its depth, its place now), everything after them zeroed."""
        end = self.slot_pos.get(slot, base + len(path))
        self.slot_pos[slot] = base + len(path)
        if slot in self._kv:
            src = torch.tensor([base + c for c in path])
            for t in self._kv[slot]:
                t[:, :, base : base + len(path)] = t[:, :, src]
                t[:, :, base + len(path) : end].zero_()

    def kv_abs_max(self, slot: int | None = None) -> float:
        """The largest |value| left in the client's KV cache, of one slot or all (0 after a wipe)."""
        if slot is None:
            caches = list(self._kv.values())
        else:
            caches = [self._kv[slot]] if slot in self._kv else []
        return max([float(t.abs().max()) for kv in caches for t in kv], default=0.0)

    # ---- one forward ----

    def _forward_batch(
        self, items: list[tuple[int, list[int]]], full: frozenset[int] = frozenset()
    ) -> list[torch.Tensor]:
        """One masked step over one or several sessions: their tokens are consecutive columns of every
        masked product; each one's attention runs over its own slot's cache at its own position.
        Each session's last-token logits (V,), or (T, V) for a slot in `full`."""
        if self.streams is None:
            if self.slot_pos:  # a rejected product ended the mask session: the caches no longer match it
                raise RuntimeError(
                    "the masked session ended mid-batch (a rejected product): its sessions must start again"
                )
            self._reset()
        spans = self._batch_spans(items)
        ends = torch.tensor([t for _, _, t in spans]).cumsum(0).tolist()
        cols = [list(range(e - t, e)) if slot in full else [e - 1] for (slot, _, t), e in zip(spans, ends, strict=True)]
        rows = torch.tensor([c for cs in cols for c in cs])
        logits = self._one_thread(lambda: self._masked_step([i for _, ids in items for i in ids], spans, rows))
        self.slot_pos.update({slot: pos + t for slot, pos, t in spans})
        out, at = [], 0
        for (slot, _, _), cs in zip(spans, cols, strict=True):
            out.append(logits[at : at + len(cs)] if slot in full else logits[at])
            at += len(cs)
        return out

    @staticmethod
    def _one_thread(step: Callable[[], torch.Tensor]) -> torch.Tensor:
        # Hundreds of tiny ops per token: OpenMP fan-out costs more than it saves (measured: client
        # CPU per SmolLM2 token 0.4-0.8 s with 2 threads, 0.15-0.25 s with 1). Restored on return.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return step()
        finally:
            torch.set_num_threads(threads)

    def _masked_step(self, ids: list[int], spans: list[tuple[int, int, int]], rows: torch.Tensor) -> torch.Tensor:
        """Every layer over the tokens `ids` of the sessions `spans` ((slot, position, T), in the
        order of `ids`); the logits (R, V) of the tokens at `rows`."""
        t = len(ids)
        wall0, cpu0, bytes0 = time.perf_counter(), time.process_time(), dict(self.tally.bytes)
        plan, c = self.plan, self.config
        mask_ranks = [r for g in plan.mask_groups for r in plan.ranks(g)]
        for r in plan.ranks("A"):  # A learns T, nothing else
            self._isend(torch.tensor([int(P.Op.FORWARD), t, 0, 0], dtype=torch.int64), r, P.KIND_CONTROL, "forward")
        # A mask group learns T, the step (its mask labels) and a guess of the next decode step's T
        # (one token per session of this step, or as many as a speculating session ran now; it works
        # ahead for it, and a wrong guess only costs it the work), which its next T tells it anyway.
        t_next = sum(1 + self.draft_hint if pos == 0 else n for _, pos, n in spans)
        word = torch.tensor([int(P.Op.FORWARD), t, t_next, self.step], dtype=torch.int64)
        for r in mask_ranks:
            self._isend(word.clone(), r, P.KIND_CONTROL, "forward")
        # Mask groups stream W_fx r_g layer by layer: post every receive now, wait for each when needed.
        self._b_in = []
        for layer in range(c.n_layers):
            bufs = {}
            for r in mask_ranks:
                g, m = plan.group_of(r)
                buf = torch.empty(plan.rows_per_layer(g, m), t, dtype=torch.int64)
                bufs[r] = (self.wire.irecv(buf, r, P.KIND_OUT, P.op_name(layer, "mask")), buf)
            self._b_in.append(bufs)
        self._b_out: dict[int, dict[int, list[torch.Tensor]]] = {}

        x_TH = arch.embed_rows(c, self.embed, torch.tensor(ids))  # (T, H): the clear residual stream, client only
        # per session: its rows of the step, its rotary tables and causal masks, its slot's cache; a token
        # tree: RoPE by depth, the ancestors' mask (generation/token_tree.py)
        step = tuple(
            DenseSpan.at(c, self.rotary, pos, n, self._kv_update(slot, pos, n), self.rotary_local)
            if slot not in self._trees
            else DenseSpan.tree(
                c, self.rotary, pos, self._trees[slot], self._kv_update(slot, pos, n), self.rotary_local
            )
            for slot, pos, n in spans
        )
        x_1TH = x_TH[None]
        for layer in range(c.n_layers):
            x_1TH = decoder_layer(self.ops, layer, x_1TH, step)
        x_TH = x_1TH[0]
        self._drain()
        if self.audit is not None:
            self.audit.end_step()
        self.step += 1
        x_TH = x_TH[rows]
        logits = rms_norm(x_TH, self.final_norm, c.rms_eps) @ self.lm_head.T  # (R, V)
        self.costs.append(
            {
                "tokens": t,
                "wall_s": time.perf_counter() - wall0,
                "client_cpu_s": time.process_time() - cpu0,
                **{k: v - bytes0[k] for k, v in self.tally.bytes.items()},
            }
        )
        return logits

    def _kv_update(self, slot: int, pos: int, t: int) -> Callable[[int, torch.Tensor, torch.Tensor], tuple]:
        """A session's cache update for dense.DenseSpan: layer i's k, v (1, n_kv, T, d) into its slot
        at pos.., every (k, v) it has so far back."""
        caches = self._cache(slot)

        def kv(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k_cache, v_cache = (cache[i] for cache in caches)  # (n_kv, S_max, d)
            k_cache[:, pos : pos + t] = k[0]
            v_cache[:, pos : pos + t] = v[0]
            return k_cache[None, :, : pos + t], v_cache[None, :, : pos + t]

        return kv

    def masked_linear(self, layer: int, op: int, x_TK: torch.Tensor) -> torch.Tensor:
        """W x for x (T, K), computed by the workers on x_fx + r; returns (T, N) fp32. Raises
        ProductRejected (naming the liars) when the product fails the check."""
        plan = self.plan
        shape = plan.shapes[op]
        t, name = x_TK.shape[0], P.op_name(layer, shape.name)
        x_fx, s = ring.encode(x_TK.T, self.w_norm_max[layer][op])  # (K, T) int64, (T,)
        assert self.streams is not None  # made at the session's reset, before any step
        r_g = [st.draw(self.step, layer, op, shape.k * t).view(shape.k, t) for st in self.streams]
        if self.audit is not None:
            self.audit.mask(self.session, self.step, layer, op)
        m_KT = x_fx.clone(memory_format=torch.contiguous_format)
        for r in r_g:
            m_KT += r  # wraps mod 2^64: uniform, whatever x is, unless every r_g is known
        sends: list = []
        outs = {}
        for rank in plan.ranks("A"):  # every member gets the whole masked input, returns its rows
            sends.append(self.wire.isend(m_KT, rank, P.KIND_MASKED, name))
            buf = torch.empty(plan.n_rows("A", plan.group_of(rank)[1], op), t, dtype=torch.int64)
            outs[rank] = (self.wire.irecv(buf, rank, P.KIND_OUT, name), buf)
        y_mask = self._mask_rows(layer, op)  # {rank: its rows}: usually already here, mask groups work ahead
        for work in sends:
            work.wait()
        for work, _ in outs.values():
            work.wait()
        y_fx = torch.cat([buf for _, buf in outs.values()])  # (N, T): W_fx (x_fx + r)
        for g in plan.mask_groups:
            y_fx -= torch.cat([y_mask[rank] for rank in plan.ranks(g)])  # W_fx x_fx once every W_fx r_g is off
        if self.verifier is not None:
            ok = self.verifier.check(layer, op, y_fx, x_fx)
            if self.audit is not None:
                self.audit.check(self.session, self.step, layer, op, t, ok)
            if not ok:
                self._reject(layer, op, {r: b for r, (_, b) in outs.items()}, y_mask, m_KT, r_g)
        ring.check_result(y_fx, name)  # |.| < 2^62 by the bound encode() checked (always, once verified)
        y = ring.decode(y_fx, self.inv_w[layer][op], s)  # rescaled, float64
        return y.T.to(torch.float32)

    def _reject(self, layer: int, op: int, y_a: dict, y_mask: dict, m_KT: torch.Tensor, r_g: list) -> None:
        """A product failed the check: find who lied (recomputing the linear from the client's own
        weights), record it, and stop the step before any token comes of it."""
        plan = self.plan
        name = P.op_name(layer, plan.shapes[op].name)
        assert self.verifier is not None  # only a checked product is rejected
        blamed = self.verifier.blame(plan, layer, op, y_a, y_mask, m_KT, dict(zip(plan.mask_groups, r_g, strict=True)))
        who = [f"group {g} member {m} (rank {r}, participant {self.order[r - 1]})" for g, m, r in blamed]
        if self.audit is not None:
            self.audit.detection(
                self.session, self.step, layer, op, [[g, m, r, self.order[r - 1]] for g, m, r in blamed]
            )
        self._drain_quietly()
        where = f"{name}, session {self.session}, step {self.step}"
        if not who:
            raise ProductRejected(
                f"a product failed the check at {where}, yet every member's rows recompute "
                "correctly: is the client's model file the workers' one?",
                [],
                [],
            )
        raise ProductRejected(
            f"wrong product from {', '.join(who)} at {where}", blamed, [self.order[r - 1] for _, _, r in blamed]
        )

    def _drain_quietly(self) -> None:
        """The step is abandoned: the sends already queued may go or fail, it no longer matters."""
        for work in self._pending:
            try:
                work.wait()
            except Exception:
                pass
        self._pending.clear()
        self.streams = None  # the session is over: the next request starts a new one (fresh keys)

    def _mask_rows(self, layer: int, op: int) -> dict[int, torch.Tensor]:
        """Each mask member's rows of W_fx r_g for (layer, op), from the groups' streams (waits for
        the layer's messages): {rank: (rows, T)}."""
        plan = self.plan
        if layer not in self._b_out:
            out: dict[int, list[torch.Tensor]] = {}
            for r, (work, buf) in self._b_in[layer].items():
                work.wait()
                g, m = plan.group_of(r)
                out[r] = list(buf.split([plan.n_rows(g, m, s.op) for s in plan.shapes]))
            self._b_out[layer] = out
            self._b_in[layer] = {}
        return {r: parts[op] for r, parts in self._b_out[layer].items()}

    # ---- the rest of Engine's interface ----

    def ping(self) -> list[dict]:
        self._drain()
        msg = control_word(P.Op.PING)
        out = []
        for r in range(1, self.plan.n + 1):
            self.wire.send(msg, r, P.KIND_CONTROL, "ping")
            reply = self.wire.recv(torch.zeros(P.CONTROL_LEN, dtype=torch.int64), r, P.KIND_CONTROL, "pong")
            out.append({"rank": r, "group": self.plan.group_of(r)[0], "peak_rss_mb": int(reply[3]) / 1024})
        return out

    def shutdown(self) -> None:
        self._drain()
        for r in range(1, self.plan.n + 1):
            self.wire.send(control_word(P.Op.SHUTDOWN), r, P.KIND_CONTROL, "shutdown")

    def close(self) -> None:
        super().close()
        audit = getattr(self, "audit", None)  # (absent when start-up failed before prepare)
        if audit is not None:
            audit.close()
