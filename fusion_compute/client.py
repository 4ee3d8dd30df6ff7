"""The structural client (rank 0, user side, trusted): embedding, ingress split, egress
reconstruction, final norm, LM head. Text and token ids never leave this process; workers get
embedding shards only. Start-up, links and close are engine.py's.
"""

from __future__ import annotations

import itertools
import time

import torch

from .config import ModelError
from .engine import EngineBase, control_word
from .engine_options import EngineOptions, effective_context
from .kernels import rms_norm
from .plan import Plan, make_plan
from .protocol import CONTROL_LEN, Op, fingerprint_int

__all__ = ["Engine", "EngineOptions", "effective_context"]


class Engine(EngineBase):
    """Client side of a structural job: the session's position and the sharded forward."""

    mode = "structural"
    supports_batch = True

    def plan_for(self, order: list[int]) -> Plan:
        return make_plan(self.config, len(order), tuple(self.seats[p].capacity for p in order))

    def welcome(self) -> dict:
        return {"capacities": [s.capacity for s in self.plan.workers]}

    # ---- protocol ----

    def _control(self, op: Op, t: int = 0, pos: int = 0, arg: int = 0) -> None:
        msg = control_word(op, t, pos, arg)
        for s in self.plan.workers:
            self.comm.send(msg, s.rank, "control", op.name.lower())

    def _replies(self, op: str, wait_s: float | None = None) -> list[torch.Tensor]:
        return [self.comm.recv(torch.zeros(CONTROL_LEN, dtype=torch.int64), s.rank, "control", op, wait_s)
                for s in self.plan.workers]  # fmt: skip

    def hello(self, deadline: float, order: list[int]) -> list[dict]:
        fp = fingerprint_int(self.plan)
        self._control(Op.HELLO, self.context, fp)
        info = []
        replies = self._replies("hello", max(1.0, deadline - time.monotonic()))  # the workers load meanwhile
        for s, reply in zip(self.plan.workers, replies, strict=True):
            ok, wfp, load_ms, rss_kb = (int(v) for v in reply)
            if not ok:
                raise ModelError(f"worker {s.rank} computed a different plan ({wfp:x} vs {fp:x}): same model and capacities?")
            info.append({"rank": s.rank, "load_s": load_ms / 1000, "peak_rss_mb": rss_kb / 1024})
        self.pos = 0
        self.slot_pos: dict[int, int] = {}  # a batch's slots: the position of each one's next token
        return info

    def ping(self) -> list[dict]:
        self._control(Op.PING)
        return [{"rank": s.rank, "peak_rss_mb": int(r[3]) / 1024} for s, r in zip(self.plan.workers, self._replies("pong"), strict=True)]

    def stats(self) -> list[dict]:
        """Per worker: collectives among workers, payload bytes sent to other workers, bytes to and
        from the client, peak RSS (MB). Counted by each worker's comm layer since it started."""
        self._control(Op.STATS)
        out = []
        for s, r in zip(self.plan.workers, self._replies("stats"), strict=True):
            coll, peer, client, rss = (int(v) for v in r)
            out.append({"rank": s.rank, "collectives": coll, "peer_bytes_sent": peer, "client_bytes": client,
                        "peak_rss_mb": rss / 1024})  # fmt: skip
        return out

    def bench_collective(self, rows: int = 300, iters: int = 1000) -> list[dict]:
        """Per worker: median / min / max µs of one reduce-scatter of `rows` fp32 per peer (T = 1)."""
        self._control(Op.BENCH_RS, rows, iters)
        wait = self.comm.timeout_s + iters  # the workers run them all before answering
        return [{"rank": s.rank, "median_us": int(r[0]) / 1000, "min_us": int(r[1]) / 1000, "max_us": int(r[2]) / 1000}
                for s, r in zip(self.plan.workers, self._replies("bench", wait), strict=True)]  # fmt: skip

    def kv_probe(self) -> list[float]:
        """Per worker, the largest |value| left in its KV shards (0 after a wipe): hygiene tests."""
        self._control(Op.PROBE)
        return [int(r[1]) / 1e6 for r in self._replies("probe")]

    def _reset(self) -> None:
        """Start a new session: workers zero their KV shards (every slot of a batch too)."""
        self._control(Op.RESET, self.batch_slots, arg=self.context)
        self.pos = 0
        self.slot_pos = {}

    def _release(self, slot: int) -> None:
        self.slot_pos.pop(slot, None)
        if self.comm is not None:  # else no epoch: the workers zero their memory at the next one's reset
            self._control(Op.RELEASE, slot)

    def _wipe(self) -> None:
        if self.comm is not None:  # else no epoch (a failed epoch change): the next one's reset zeroes them
            self._control(Op.WIPE)

    def shutdown(self) -> None:
        self._control(Op.SHUTDOWN)

    def _forward(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run tokens `ids` at the session's current position; returns logits (V,) of the last
        token, or (T, V) with all_logits. Ingress: x[:, R_w] to worker w; egress: shards back."""
        t = len(ids)
        if self.pos + t > self.context:
            raise ValueError(f"{self.pos + t} tokens exceed the context window of {self.context}")
        x_HT = self.embed[torch.tensor(ids)].T.contiguous()  # (H, T), full: fine, this is the client
        self._control(Op.FORWARD, t, self.pos)
        for s in self.plan.workers:
            a, b = s.residual
            self.comm.send(x_HT[a:b], s.rank, "ingress", "embed")
        shards = [
            self.comm.recv(torch.empty(s.n_residual, t), s.rank, "egress", "final") for s in self.plan.workers
        ]
        self.pos += t
        x_TH = torch.cat(shards).T  # (T, H): reconstructed on the user side only
        if not all_logits:
            x_TH = x_TH[-1:]
        logits = rms_norm(x_TH, self.final_norm, self.config.rms_eps) @ self.lm_head.T  # (T, V)
        return logits if all_logits else logits[0]

    def _forward_batch(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One step over several slots: their tokens as consecutive columns of one ingress, one
        collective per operator for all of them (protocol.Op.FORWARD_BATCH)."""
        spans = self._batch_spans(items)
        ids = [i for _, seq in items for i in seq]
        total = len(ids)
        x_HT = self.embed[torch.tensor(ids)].T.contiguous()  # (H, ΣT), full: fine, this is the client
        self._control(Op.FORWARD_BATCH, len(spans), total)
        span_words = torch.tensor(spans, dtype=torch.int64).reshape(-1)
        for s in self.plan.workers:
            a, b = s.residual
            self.comm.send(span_words, s.rank, "control", "spans")
            self.comm.send(x_HT[a:b], s.rank, "ingress", "embed")
        shards = [
            self.comm.recv(torch.empty(s.n_residual, total), s.rank, "egress", "final") for s in self.plan.workers
        ]
        self.slot_pos.update({slot: pos + t for slot, pos, t in spans})
        last = torch.tensor(list(itertools.accumulate(t for _, _, t in spans))) - 1  # each span's last column
        x_nH = torch.cat(shards).T[last]  # (n, H): each session's last token, on the user side only
        # V x n rather than n x V: the BLAS streams the (V, H) head once for all n (8 rows: 12 vs 18 ms here)
        logits_Vn = self.lm_head @ rms_norm(x_nH, self.final_norm, self.config.rms_eps).T
        return list(logits_Vn.T)
