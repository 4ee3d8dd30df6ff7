"""The structural client (rank 0, user side, trusted): embedding, layer 0's normalised q/k/v (the
ingress carries each worker its residual shard and its q/k/v shard), egress sum (the workers' last
down partials), final norm, LM head. Text and token ids never leave this process; workers get
embedding shards only. Start-up, links and close are engine.py's.
"""

from __future__ import annotations

import itertools
import time
from enum import IntEnum

import torch

from ..comm.buffers import accumulate
from ..comm.value_checks import ROW_SUMSQ_LIMIT
from ..errors import WorkerMisbehaved, WorkersSuspected
from ..model import architecture as arch
from ..model.config import ModelError
from ..model.kernels import linear_fm, rms_norm
from ..runtime.engine import EngineBase, control_word
from ..runtime.engine_options import EngineOptions, effective_context
from .plan import Plan, make_plan
from .protocol import CONTROL_LEN, Op, fingerprint_int

__all__ = ["Engine", "EngineOptions", "effective_context"]

# The largest sum of squares of one token's residual row that the final norm's float32 arithmetic
# (x.pow(2).mean() in rms_norm) carries without overflow: half of float32's largest value (a float32
# sum of H squares is off its exact value by at most about H x 2^-24 of it, far under a half for any
# model's H). Model-independent; Engine._check_egress says why an honest residual never reaches it.
EGRESS_SCALE_LIMIT = ROW_SUMSQ_LIMIT


def layer0_qkv(
    src, plan: Plan, device: torch.device, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per worker of `plan`: its rows of layer 0's q/k/v weight (the norm's gain folded in, as the
    workers fold it: sharded.load_layer) and of the bias. The client computes layer 0's q/k/v itself
    and sends each worker its rows with the ingress, so the layer-0 QKV scatter goes (one exchange
    fewer per forward). All of one layer's W_qkv: (n_h + 2 n_kv) d x H values (SmolLM2-135M: 960 x
    576, 2.2 MB in float32)."""
    w_qkv = arch.read_weight(src, 0, "qkv") * arch.read_norm(src, 0, "qkv")
    bias = arch.read_bias(src, 0, "qkv")
    out = []
    for w in range(plan.n):
        rows = torch.tensor(plan.qkv_rows(w))
        b = None if bias is None else bias[rows].to(device=device, dtype=dtype)
        out.append((w_qkv[rows].to(device=device, dtype=dtype), b))
    return out


def ingress_qkv(
    x_HT: torch.Tensor, qkv0: list[tuple[torch.Tensor, torch.Tensor | None]], hidden: int, eps: float
) -> list[torch.Tensor]:
    """Each worker's layer-0 q/k/v (qkv_w, ΣT) from the full x_HT: W[rows] · RMSNorm(x) + b, as the
    norm-fused scatter computes it (ops.norm_linear_scatter: Σx² in float32, the product in the
    dtype, divided by s = sqrt(Σx² / H + ε), the bias after)."""
    xf = x_HT.float()
    inv_s = torch.rsqrt((xf * xf).sum(0) / hidden + eps)
    out = []
    for w_rows, b in qkv0:
        qkv = (linear_fm(w_rows, x_HT) * inv_s).to(x_HT.dtype)
        out.append(qkv if b is None else qkv + b[:, None])
    return out


class Engine(EngineBase):
    """Client side of a structural job: the session's position and the sharded forward."""

    mode = "structural"
    verifies_trees = True  # the workers' attention takes a tree's mask and depths (ops.make_step)
    plan: Plan  # the current epoch's (plan_for)

    def plan_for(self, order: list[int]) -> Plan:
        return make_plan(self.config, len(order), tuple(self.seats[p].capacity for p in order))

    def welcome(self) -> dict:
        return {"capacities": [s.capacity for s in self.plan.workers]}  # (the dtype: engine.welcome_for)

    # ---- protocol ----

    def _control(self, op: IntEnum, t: int = 0, pos: int = 0, arg: int = 0) -> None:
        msg = control_word(op, t, pos, arg)
        self.wire.begin_step()  # each worker starts it as the word arrives (comm.py, "Numbered steps")
        for s in self.plan.workers:
            self.wire.send(msg, s.rank, "control", op.name.lower())

    def _replies(self, op: str, wait_s: float | None = None) -> list[torch.Tensor]:
        return [
            self.wire.recv(torch.zeros(CONTROL_LEN, dtype=torch.int64), s.rank, "control", op, wait_s)
            for s in self.plan.workers
        ]

    def _layer0_qkv(self) -> None:
        """This plan's workers' rows of layer 0's q/k/v weights (`layer0_qkv`), placed with the LM head."""
        self.qkv0 = layer0_qkv(self.src, self.plan, self.client_device, self.dtype)

    def _ingress_qkv(self, x_HT: torch.Tensor) -> list[torch.Tensor]:
        return ingress_qkv(x_HT, self.qkv0, self.config.hidden, self.config.rms_eps)

    def hello(self, deadline: float, order: list[int]) -> list[dict]:
        self._layer0_qkv()  # (this epoch's plan: a new seat count moves the rows)
        fp = fingerprint_int(self.plan)
        self._control(Op.HELLO, self.context, fp)
        info = []
        replies = self._replies("hello", max(1.0, deadline - time.monotonic()))  # the workers load meanwhile
        for s, reply in zip(self.plan.workers, replies, strict=True):
            ok, wfp, load_ms, rss_kb = (int(v) for v in reply)
            if ok != 1 or wfp != fp:  # the fingerprint it states is checked too, not only its word
                who = f"worker {s.rank} (participant {order[s.rank - 1]})"
                raise ModelError(
                    f"{who} computed a different plan ({wfp:x} vs {fp:x}): same model and capacities?"
                    if ok == 0
                    else f"{who} answered the plan handshake with word {ok} and fingerprint "
                    f"{wfp:x}, not 1 and {fp:x}: refused"
                )
            info.append({"rank": s.rank, "load_s": load_ms / 1000, "peak_rss_mb": rss_kb / 1024})
        self.slot_pos: dict[int, int] = {}  # each open slot: the position of each one's next token
        self._kept: dict[int, tuple[int, ...]] = {}  # per slot: its tree step's kept columns, told at its next step
        return info

    def ping(self) -> list[dict]:
        self._control(Op.PING)
        return [
            {"rank": s.rank, "peak_rss_mb": int(r[3]) / 1024}
            for s, r in zip(self.plan.workers, self._replies("pong"), strict=True)
        ]

    def ask(
        self, op: IntEnum, reply: str, t: int = 0, pos: int = 0, arg: int = 0, wait_s: float | None = None
    ) -> list[torch.Tensor]:
        """One control word of an op beyond the protocol's (one the workers' start-up added to their
        op table: the bench's, bench/ops.py) to every worker, and each one's reply, in rank order."""
        self._control(op, t, pos, arg)
        return self._replies(reply, wait_s)

    def _reset(self) -> None:
        """Start a new session: workers zero their KV shards (every slot of a batch too)."""
        self._control(Op.RESET, self.batch_slots, arg=self.context)
        self.slot_pos = {}
        self._kept = {}

    def _release(self, slot: int) -> None:
        self.slot_pos.pop(slot, None)
        self._kept.pop(slot, None)
        if self.comm is not None:  # else no epoch: the workers zero their memory at the next one's reset
            self._control(Op.RELEASE, slot)

    def _wipe(self) -> None:
        if self.comm is not None:  # else no epoch (a failed epoch change): the next one's reset zeroes them
            self._control(Op.WIPE)

    def shutdown(self) -> None:
        self._control(Op.SHUTDOWN)

    def _forward_batch(
        self, items: list[tuple[int, list[int]]], full: frozenset[int] = frozenset()
    ) -> list[torch.Tensor]:
        """One step over one or several slots: their tokens as consecutive columns of one ingress, one
        collective per operator for all of them (protocol.Op.FORWARD). Ingress: x[:, R_w] to worker w and
        its rows of layer 0's q/k/v (computed here: `_ingress_qkv`; no layer-0 QKV scatter); egress: each worker's (H, ΣT)
        last down partial, its residual rows added (with post-norms: its rows of the final residual,
        zeros elsewhere), summed here (plan.boundary; structural/ops.py, ShardedLayer.to_client).
        Returns each slot's last-token logits (V,), or (T, V) for a slot in `full`."""
        spans = self._batch_spans(items)
        ids = [i for _, seq in items for i in seq]
        total = len(ids)
        # (H, ΣT), full: fine, this is the client (Gemma: scaled by √H, as the workers' layer 0 expects)
        x_HT = arch.embed_rows(self.config, self.embed, torch.tensor(ids)).T.contiguous()
        qkv0 = self._ingress_qkv(x_HT)
        tree_words = self._tree_words(spans)
        self._control(Op.FORWARD, len(spans), total, len(tree_words))
        span_words = torch.tensor(spans, dtype=torch.int64).reshape(-1)
        trees = torch.tensor(tree_words, dtype=torch.int64)
        for s, qkv in zip(self.plan.workers, qkv0, strict=True):
            a, b = s.residual
            self.wire.send(span_words, s.rank, "control", "spans")
            if tree_words:  # in the same exchange as the spans and the ingress: no extra round
                self.wire.send(trees, s.rank, "control", "tree")
            self.wire.send(x_HT[a:b], s.rank, "ingress", "embed")
            self.wire.send(qkv, s.rank, "ingress", "qkv0")
        for slot, _, _ in spans:
            self._kept.pop(slot, None)  # told
        # all workers' egress waited on at once: a worker is charged only the wait after every other's
        # shard had arrived (comm.Comm.recv_all), so the client's own account names the late one
        H = self.config.hidden
        got = self.wire.recv_all(
            {s.rank: torch.empty(H, total, dtype=self.dtype) for s in self.plan.workers}, "egress", "final"
        )
        shards = [got[s.rank] for s in self.plan.workers]
        self._check_egress(shards)
        # Σ_w e_w = x_mid + W_down h: one float32 accumulator, rounded once (as a reduce-scatter sums)
        x_HT = accumulate(torch.stack(shards))
        self.slot_pos.update({slot: pos + t for slot, pos, t in spans})
        ends = list(itertools.accumulate(t for _, _, t in spans))
        cols = [list(range(e - t, e)) if slot in full else [e - 1] for (slot, _, t), e in zip(spans, ends, strict=True)]
        picked = [c for cs in cols for c in cs]
        x_cH = x_HT.to(self.client_device).T[torch.tensor(picked)]  # on the user side only
        x_cH = rms_norm(x_cH, self.final_norm, self.config.rms_eps)
        if len(spans) == 1:
            logits_cV = x_cH @ self.lm_head.T  # (T or 1, V)
        else:  # V x n rather than n x V: the BLAS streams the (V, H) head once for all n (8 rows: 12 vs 18 ms here)
            logits_cV = (self.lm_head @ x_cH.T).T
        logits_cV = logits_cV.float().cpu()  # the sampler's and the drafter's: float32, host (no-ops on a CPU fp32 run)
        self._check_logits(logits_cV, shards, picked)
        out, at = [], 0
        for (slot, _, _), cs in zip(spans, cols, strict=True):
            out.append(logits_cV[at : at + len(cs)] if slot in full else logits_cV[at])
            at += len(cs)
        return out

    def _tree_words(self, spans: list[tuple[int, int, int]]) -> list[int]:
        """The step's token trees and kept paths for the workers (protocol.Op.FORWARD's tree words):
        per span [n_parents, n_keep, parents..., kept columns...]; none when no span has either."""
        if not self._trees and not self._kept:
            return []
        words: list[int] = []
        for slot, _, _ in spans:
            parents, keep = self._trees.get(slot, ()), self._kept.get(slot, ())
            words += [len(parents), len(keep), *parents, *keep]
        return words

    def _keep(self, slot: int, base: int, path: list[int]) -> None:
        """The slot's next step starts after the kept path; that step's tree words name the kept columns,
        and the workers move their entries there first (ShardedModel.roll_back)."""
        self.slot_pos[slot] = base + len(path)
        self._kept[slot] = tuple(path)

    def _check_egress(self, shards: list[torch.Tensor]) -> None:
        """Every egress (a worker's full-width partial of the final residual) must be finite and of a
        scale the model can produce: a NaN, an
        infinity or a finite ±3e38 from a worker would become token 0 (greedy: the final norm's
        float32 sum of squares overflows, every logit is 0), a sampling error, or drafts accepted
        for nothing, naming nobody. Raises WorkerMisbehaved naming the worker, before anything is
        computed from the step: the engine removes it (membership._expel; a standby takes its seat)
        and the request fails. Two passes over H x T floats, next to the step's round trips.

        The scale: each token's sum of squares over its whole residual row (the egresses' sum, in
        float64), must stay under EGRESS_SCALE_LIMIT, what the final norm's float32 arithmetic carries. An honest
        residual above it would overflow the model's own norm, in HF transformers too; real ones
        are far below (SmolLM2-135M, its final residual over four 96-token prompts, random ids,
        1..96, all 1, all 2: at most 3.8e7, with values up to 4.4e3, against a limit of 1.7e38). Over
        it, every worker whose egress holds more than limit / N² of some row's sum of squares is named:
        at least one does (‖Σ_w e_w‖ <= Σ_w ‖e_w‖, so if every ‖e_w‖² were at most limit / N², the
        sum's would be at most the limit). These are checks against crashes and gross faults, not integrity: a
        worker that computes wrong but plausible values passes them (README's threat model).

        Why naming the worker is sound even when a peer fed it poisoned partials: every worker checks
        its own egress by the same two rules before it sends it (comm/value_checks.py, egress_fault:
        finite, each token's sum of squares at most the limit / N²) and, when it fails, leaves saying
        so instead of sending it (TaintedInputs: nobody is named on that). So a shard that fails here
        is one its sender's own check refused: only a worker that skipped the check sends it."""
        for s, shard in zip(self.plan.workers, shards, strict=True):
            if not bool(torch.isfinite(shard).all()):
                bad, pid = int((~torch.isfinite(shard)).sum()), self.order[s.rank - 1]
                raise WorkerMisbehaved(
                    f"worker {s.rank} (participant {pid}) sent an egress shard holding {bad} NaN "
                    f"or infinite value(s) of {shard.numel()}",
                    [pid],
                    reason="sent a non-finite egress shard (caught by the finiteness check)",
                )
        sumsq = [shard.double().square().sum(0) for shard in shards]  # (ΣT,) per worker, float64: cannot overflow
        rows = torch.stack([shard.double() for shard in shards]).sum(0).square().sum(0)  # the final residual's
        if bool((rows <= EGRESS_SCALE_LIMIT).all()):
            return
        share, named = EGRESS_SCALE_LIMIT / len(shards) ** 2, {}
        for s, ss in zip(self.plan.workers, sumsq, strict=True):
            if bool((ss > share).any()):
                pid = self.order[s.rank - 1]
                named[pid] = f"worker {s.rank} (participant {pid}): sum of squares {float(ss.max()):.3g}"
        raise WorkerMisbehaved(
            f"egress beyond any residual the model can produce (a token's sum of squares over "
            f"{EGRESS_SCALE_LIMIT:.3g}): {'; '.join(named.values())}",
            sorted(named),
            reason="sent an egress shard of impossible scale (caught by the scale check)",
        )

    def _check_logits(self, logits_cV: torch.Tensor, shards: list[torch.Tensor], picked: list[int]) -> None:
        """After the checks on the shards, a row of logits that is not finite, or constant (every
        token equally likely: greedy would emit token 0), cannot come from an honest step. But shards
        that passed their checks were made from every worker's partials: a liar could have fed an
        honest worker the values that make the row so, and the client cannot tell which. Nobody is
        convicted: WorkersSuspected, every worker of the epoch a suspect, those whose shards carry
        the most of that token's residual (its egress's sum of squares) first (set aside first)."""
        finite = torch.isfinite(logits_cV).all(-1)
        flat = logits_cV.amax(-1) == logits_cV.amin(-1)
        bad = (~finite) | flat
        if not bool(bad.any()):
            return
        i = int(bad.nonzero()[0, 0])  # the first such row, in the order the logits were made
        col = torch.stack([shard[:, picked[i]].double().square().sum() for shard in shards])  # (N,): row i's token
        ranks = sorted(range(len(shards)), key=lambda r: -float(col[r]))  # the largest share first
        pids = [self.order[self.plan.workers[r].rank - 1] for r in ranks]
        what = "not finite" if not bool(finite[i]) else "constant"
        raise WorkersSuspected(
            f"a row of logits is {what}: no honest step makes it, and every worker contributed to it "
            f"(the largest share of that token's residual first): suspects {pids}",
            pids,
        )
