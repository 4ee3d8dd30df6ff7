"""What a block of values a worker puts on the wire may hold (docs/resilience.md, "Evidence at the
receiver"): every value finite and at most PEER_VALUE_LIMIT in magnitude, for the partials of a
reduce-scatter and of a score sum; and, for the egress a worker returns to the client (its partial
of the final residual), each token's sum of squares (float64) at most ROW_SUMSQ_LIMIT / N² (the share
over which the client names it).

The same function judges a block on both ends: the sender checks the block it is about to send, and
refuses to send one that fails (comm.Comm: TaintedInputs, "my own output failed; my inputs made it
or I did"), and the receiver checks every block it gets before adding it (PeerPoisoned, naming the
sender first-hand). The wire carries the block's bytes exactly, so a block that fails at the
receiver is one its sender's own check would have refused: an honest sender never sends it, and a
receiver that names the sender names a worker that skipped the check, whatever the bound. That is
why the conviction is sound without a bound that no honest model can reach: the bound only decides
how soon a gross value is caught, and an honest worker whose own block reaches it (its inputs passed
one by one, but together made it, or its model is at float32's edge) leaves saying so, which
convicts nobody (runtime/blame.py: every contributor becomes a suspect).

Why this bound. An honest residual value stays under sqrt(float32 max) ≈ 1.8e19: the next RMSNorm
squares it in float32 (transformers' too), and a larger one makes that square infinite. A partial is
a term of such a residual (or of q·k of normalised vectors), and real ones are many orders below:
SmolLM2-135M's largest residual value over four 96-token prompts is 4.4e3. PEER_VALUE_LIMIT =
sqrt(float32 max / 2) ≈ 1.3e19 sits at that edge, so an honest model never gets near it; any value
over it (±1e30, ±3e38) or any NaN/inf is refused. What passes is not thereby right: a wrong but
plausible partial passes (only the masked mode verifies products).
"""

from __future__ import annotations

import math

import torch

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# A token's sum of squares over its whole residual row that the final norm's float32 arithmetic
# carries: half of float32's largest value (structural/client.py names an egress shard over 1/N of it).
ROW_SUMSQ_LIMIT = _FLOAT32_MAX / 2
PEER_VALUE_LIMIT = math.sqrt(_FLOAT32_MAX / 2)  # ≈ 1.3e19: see the module docstring


def block_fault(block: torch.Tensor) -> str | None:
    """Why `block` (a partial of a reduce-scatter or a score sum) cannot be on the wire, or None when
    every value is finite and at most PEER_VALUE_LIMIT in magnitude. One reduction over the block when
    it passes; the reasons are counted only when it does not."""
    if block.numel() == 0:
        return None
    # The usual case in one pass: every value within the bound (a NaN fails both comparisons, and
    # aminmax carries it). A separate isfinite, all, abs and max cost 8-17 us a decode block and ~110 us a
    # 1536 x 32 one, against 2 and ~11 (one torch thread, this project's 2-core machine); every
    # partial of every reduce-scatter is checked twice, by its sender and its receiver.
    lo, hi = torch.aminmax(block)
    if -PEER_VALUE_LIMIT <= float(lo) and float(hi) <= PEER_VALUE_LIMIT:
        return None
    finite = torch.isfinite(block)
    if not bool(finite.all()):
        return f"{int((~finite).sum())} NaN or infinite value(s) of {block.numel()}"
    peak = float(block.abs().max())
    if peak > PEER_VALUE_LIMIT:
        over = int((block.abs() > PEER_VALUE_LIMIT).sum())
        return f"{over} value(s) over {PEER_VALUE_LIMIT:.3g} in magnitude (the largest {peak:.3g})"
    return None


def egress_fault(shard: torch.Tensor, n_workers: int) -> str | None:
    """Why a worker's egress (its full-width partial of the final residual, one column per token;
    the client sums the N workers') cannot go to the client, or None: a NaN or infinity, or a token
    whose sum of squares (float64) is over ROW_SUMSQ_LIMIT / n_workers², the share over which the
    client's scale check names the worker that sent it (structural/client.py, Engine._check_egress:
    N partials each within it sum to a row within the limit)."""
    finite = torch.isfinite(shard)
    if not bool(finite.all()):
        return f"{int((~finite).sum())} NaN or infinite value(s) of {shard.numel()}"
    if shard.numel() == 0:
        return None
    sumsq = float(shard.double().square().sum(0).max())
    share = ROW_SUMSQ_LIMIT / n_workers**2
    if sumsq > share:
        return f"a token's sum of squares {sumsq:.3g}, over {share:.3g} (its share of the limit)"
    return None


__all__ = ["PEER_VALUE_LIMIT", "ROW_SUMSQ_LIMIT", "block_fault", "egress_fault"]
