"""The sharded model of one worker: its weight slices, its residual and KV shards, every layer.

`ShardedModel.forward(x_dT, spans)` maps this worker's residual shard at ingress to its egress (the
last layer's full-width down partial, its own residual rows added: the client sums the workers'), for one session or a batch of them (one `ops.Span` each: KV slot, position, token
count); the state is never gathered in between (ops.py has the operators, comm.py the wire).
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..model import architecture as arch
from ..model.dense import rotaries
from ..weights.loader import WeightSource
from .ops import LayerIndex, LayerShard, ShardedLayer, Span, Step, make_step
from .plan import Plan, runs


def augmented(fused: torch.Tensor, plan_rows: list[list[int]]) -> torch.Tensor:
    """Rows of `fused` regrouped by owner, each owner's chunk followed by one zero row (the slot
    where the sender writes its local sum of squares)."""
    zero = fused.shape[0]
    padded = torch.cat([fused, fused.new_zeros(1, fused.shape[1])])
    index = [r for rows in plan_rows for r in rows + [zero]]
    return padded.index_select(0, torch.tensor(index))


def load_layer(src: WeightSource, plan: Plan, w: int, layer: int, replicated: bool = False) -> LayerShard:
    """Worker w's slices of one layer, norm gains folded into the input columns it holds; none of a
    linear the client computes (`plan.given`: layer 0's q/k/v, its weights, bias and norm gain are
    never read: qkv_w is (0, d_r)).

    Sharded (the default): the input columns of its residual range, every owner's output rows
    regrouped by owner with a zero row each for Σx² (`augmented`, plan.py). `replicated` (the
    Megatron-style baseline, megatron.py): all H input columns and only its own qkv / gate-up rows
    (column-parallel; the norm runs on the full residual, so nothing to fuse), and its residual
    coordinates are all of them. o / down: its columns of the attention / MLP outputs either way."""
    share = plan.workers[w]
    a, b = (0, plan.config.hidden) if replicated else share.residual
    cols = [(a, b)]
    n = plan.n

    qkv_rows = [plan.qkv_rows(q) for q in range(n)]
    gu_rows = [plan.gate_up_rows(q) for q in range(n)]
    o_cols = plan.o_cols(w)
    res_off = sum(plan.residual_sizes[:w])  # o / down outputs are split in natural row order
    index = LayerIndex(
        resid_in=list(range(a, b)),
        qkv_out=qkv_rows[w],
        attn_in=o_cols,
        resid_out=list(range(a, b)) if replicated else list(range(res_off, res_off + plan.residual_sizes[w])),
        gu_out=gu_rows[w],
        h_in=list(range(*share.mlp)),
    )

    # the norm's gain folds into the columns this worker holds (docs/design.md, "The operators": RMSNorm fused into the linear)
    if plan.given(layer, "qkv"):  # the client sends this worker its q/k/v rows (ops.ShardedLayer.given_qkv)
        qkv_w, qkv_b = torch.empty(0, b - a), None
    else:
        qkv = arch.read_weight(src, layer, "qkv", cols=cols) * arch.read_norm(src, layer, "qkv")[a:b]
        qkv_w = qkv[torch.tensor(qkv_rows[w])].contiguous() if replicated else augmented(qkv, qkv_rows)
        del qkv
        bias = arch.read_bias(src, layer, "qkv")
        qkv_b = None if bias is None else bias[torch.tensor(qkv_rows[w])].contiguous()
    o_w = arch.read_weight(src, layer, "o", cols=runs(o_cols))

    gu = arch.read_weight(src, layer, "gate_up", cols=cols) * arch.read_norm(src, layer, "gate_up")[a:b]
    gu_w = gu[torch.tensor(gu_rows[w])].contiguous() if replicated else augmented(gu, gu_rows)
    del gu
    down_w = arch.read_weight(src, layer, "down", cols=[share.mlp])
    return LayerShard(
        qkv_w=qkv_w,
        qkv_b=qkv_b,
        o_w=o_w,
        gu_w=gu_w,
        down_w=down_w,
        index=index,
        qk_w=qk_gains(src, plan, w, layer),
        post_w=post_gains(src, layer, index.resid_out),
    )


def post_gains(src: WeightSource, layer: int, rows: list[int]) -> torch.Tensor | None:
    """The post-norm gains (2, |rows|) after o and after down at the residual `rows` this worker's
    o / down outputs stand for (Gemma 3), or None for a family without post-norms."""
    o, down = (arch.read_post_norm(src, layer, name) for name in ("o", "down"))
    if o is None or down is None:
        return None
    return torch.stack([o, down])[:, torch.tensor(rows)].contiguous()


def qk_gains(src: WeightSource, plan: Plan, w: int, layer: int) -> tuple[torch.Tensor, ...] | None:
    """Per attention block of worker w: the q_norm and k_norm gains (2, dl) of the block's head dims
    (Qwen3's per-head norms), or None for a family without them."""
    norms = arch.read_qk_norms(src, layer)
    if norms is None:
        return None
    d = plan.config.head_dim
    return tuple(torch.stack(norms)[:, torch.tensor(b.head_dims(d))] for b in plan.workers[w].attention)


class ShardedModel:
    """All layers of one worker. `forward(x_dT, spans)` maps this worker's residual shard at
    ingress to its egress e_HT (H, ΣT), whose sum over the workers is the final residual (ops.py,
    `to_client`); the state is never gathered in between.
    (`layer_class` and `replicated`: what megatron.MegatronModel changes.)"""

    layer_class: type[ShardedLayer] = ShardedLayer
    replicated = False  # load_layer's slicing

    def __init__(
        self,
        src: WeightSource,
        plan: Plan,
        w: int,
        comm: Comm,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        """`device` and `dtype`: where the weight slices, the KV cache and every step's tensors live
        (runtime/placement.py); each layer's slices are placed as they are read."""
        c = plan.config
        self.plan, self.w, self.comm = plan, w, comm
        self.device, self.dtype = device or torch.device("cpu"), dtype
        self.layers = [self.make_layer(src, i) for i in range(c.n_layers)]
        self.layers[-1].egress = True  # its output is the egress (H, ΣT), summed by the client (ops.py)
        # its down partials go to the client, unless a post-norm needs the summed y first (ops.py)
        self.layers[-1].to_client = plan.down_to_client
        self.rotary, self.rotary_local = rotaries(c)
        self.max_seq = self.n_slots = 0
        self.lengths: list[int] = []  # per KV slot: the positions its session has written (0..len-1)

    def make_layer(self, src: WeightSource, i: int) -> ShardedLayer:
        """Layer i with its slices read and placed."""
        plan, w, c = self.plan, self.w, self.plan.config
        return self.layer_class(
            i,
            load_layer(src, plan, w, i, self.replicated).to(self.device, self.dtype),
            plan.workers[w].attention,
            comm=self.comm,
            me=w,
            qkv_sizes_aug=[s + 1 for s in plan.qkv_sizes],
            gu_sizes_aug=[s + 1 for s in plan.gate_up_sizes],
            res_sizes=list(plan.residual_sizes),
            hidden=c.hidden,
            head_dim=c.head_dim,
            group_size=c.group_size,
            eps=c.rms_eps,
            window=c.window(i),
            scale=c.scale,
            activation=c.activation,
        )

    def attach_audit(self, audit) -> None:
        for layer in self.layers:
            layer.audit = audit

    def reset(self, max_seq: int, slots: int = 1) -> None:
        """Zeroed KV shards for a new session (or a batch of `slots` sessions): the old ones are
        zeroed in place (and replaced only when the size changes), so no earlier session's keys or
        values stay in memory."""
        self.wipe()
        self.lengths = [0] * slots
        if (max_seq, slots) != (self.max_seq, self.n_slots):
            self.max_seq, self.n_slots = max_seq, slots
            for layer in self.layers:
                layer.caches = []  # the old buffers go before the new ones are made
            for layer in self.layers:
                layer.alloc_cache(max_seq, self.dtype, self.device, slots)

    def wipe(self, slot: int | None = None) -> None:
        """Zero every KV shard in place (session end, revocation, shutdown), or one slot's."""
        for layer in self.layers:
            for cache in layer.caches:
                for t in (cache.k, cache.v):
                    (t if slot is None else t[slot]).zero_()
        if slot is None:
            self.lengths = [0] * len(self.lengths)
        elif slot < len(self.lengths):
            self.lengths[slot] = 0

    def roll_back(self, spans: list[Span], measure: bool = False) -> list[tuple[int, int, int, bool | None]]:
        """Before a step: a span that starts below what its slot holds re-runs those positions
        (speculative decoding rejected them): the slot's positions from there on are zeroed first,
        so a rejected key or value is never attended, nor kept. Returns (slot, held, pos, zeroed)
        per rollback, zeroed measured when `measure` (the audit's rollback record; else None: the
        scan of the slot's tail costs a pass over its KV). A span at position 0 is a new
        session, not a rollback: its slot was zeroed at the release (a worker that kept it is the
        audit's keep-slots control, caught at the release's measurement)."""
        out = []
        for s in spans:
            if s.keep is not None:
                self._compact(s)
            if s.slot < len(self.lengths) and 0 < s.pos < self.lengths[s.slot]:
                held = self.lengths[s.slot]
                for layer in self.layers:
                    for cache in layer.caches:
                        cache.k[s.slot, :, s.pos : held].zero_()
                        cache.v[s.slot, :, s.pos : held].zero_()
                self.lengths[s.slot] = s.pos
                zeroed = (
                    not any(
                        bool(t[s.slot, :, s.pos :].any())
                        for layer in self.layers
                        for cache in layer.caches
                        for t in (cache.k, cache.v)
                    )
                    if measure
                    else None
                )
                out.append((s.slot, held, s.pos, zeroed))
        return out

    def _compact(self, s: Span) -> None:
        """A token tree's accepted path (`s.keep`, columns of the slot's last step, which began at
        base = s.pos - len(keep)): column keep[i]'s keys and values move to base + i, in order (each
        moves down or stays, so none is overwritten before it moved); roll_back then zeroes the
        positions from s.pos on, the dropped columns among them. The keys stay valid: column keep[i]
        was rotated at base + its depth, which is base + i on a path."""
        keep, base = s.keep or (), s.pos - len(s.keep or ())
        held = self.lengths[s.slot] if s.slot < len(self.lengths) else 0
        if (
            not keep
            or keep[0] != 0
            or any(b <= a for a, b in zip(keep, keep[1:], strict=False))
            or base < 0
            or base + keep[-1] >= held
        ):
            raise ValueError(f"cannot keep columns {list(keep)} of a step at {base} in a slot holding {held}")
        src = torch.tensor([base + c for c in keep], device=self.device)
        dst = torch.arange(base, base + len(keep), device=self.device)
        for layer in self.layers:
            for cache in layer.caches:
                cache.k[s.slot, :, dst] = cache.k[s.slot, :, src]
                cache.v[s.slot, :, dst] = cache.v[s.slot, :, src]

    def kv_abs_max(self, slot: int | None = None) -> float:
        """Largest |value| left in the KV shards, or in one slot's (0 after a wipe): hygiene tests
        and the audit's release records read it."""
        caches = [t if slot is None else t[slot] for layer in self.layers for c in layer.caches for t in (c.k, c.v)]
        return max((float(t.abs().max()) for t in caches if t.numel()), default=0.0)

    def rebind(self, comm: Comm) -> None:
        """Use another epoch's links with the same plan and rank (the weights stay loaded)."""
        self.comm = comm
        for layer in self.layers:
            layer.comm = comm

    def _step(self, spans: list[Span]) -> Step:
        """RoPE tables for every column and each span's causal mask, after checking the KV capacity."""
        for s in spans:
            if s.pos + s.t > self.max_seq:
                raise ValueError(f"position {s.pos + s.t} beyond the session's KV capacity {self.max_seq}")
            if s.slot >= self.n_slots:
                raise ValueError(f"KV slot {s.slot} beyond the {self.n_slots} made at the session's start")
        for s in spans:
            self.lengths[s.slot] = max(self.lengths[s.slot], s.pos + s.t)
        return make_step(spans, self.rotary, self.device, self.dtype, self.plan.config.windows)

    def _layer_steps(self, spans: list[Span]) -> list[Step]:
        """Each layer's step: `_step`'s, or for a local layer of a model whose local layers rotate
        with their own RoPE (Gemma 3: config.rope_local) the same with that RoPE's tables."""
        step, c = self._step(spans), self.plan.config
        if self.rotary_local is None:
            return [step] * len(self.layers)
        local = make_step(spans, self.rotary_local, self.device, self.dtype, c.windows)
        return [local if c.local_rope(i) else step for i in range(len(self.layers))]

    def forward(self, x_dT: torch.Tensor, spans: list[Span], qkv_aT: torch.Tensor) -> torch.Tensor:
        """x_dT (d_w, ΣT): the spans' tokens as consecutive columns (one span: one session in slot 0);
        qkv_aT: layer 0's q/k/v rows of this worker, from the client. Returns the egress e_HT (H, ΣT)."""
        self.layers[0].given_qkv = qkv_aT
        for layer, step in zip(self.layers, self._layer_steps(spans), strict=True):
            x_dT = layer.forward(x_dT, step)
        return x_dT
