"""The hooks a worker process offers what is not the honest protocol: a test's faulty worker, the
audit's leaky one (its negative controls), the replicated-residual baseline, and the control ops
the benchmark adds. They are chosen once at start-up by the command line (fusion_compute/controls/
builds them from `--inject-fault`, `--inject-leak` and `--variant`; bench/ops.py holds the bench's
ops), so the worker's loops carry no branch for them and import none of their code.

  Controls   the honest worker's: every hook the identity, the model the sharded one.
  OpHandler  an op beyond the protocol's (protocol.Op): the worker's op loop looks an unknown op up
             in its options' table (WorkerOptions.ops) and calls it with the epoch's state.
"""

from __future__ import annotations

from collections.abc import Callable

from ..comm import Comm
from ..model.config import ModelConfig
from .plan import Plan
from .sharded import ShardedModel

# (model, comm, plan, t, pos, arg): the epoch's model and comm, its plan, and the control word's
# three arguments; it answers the client on the control link itself (or not at all).
OpHandler = Callable[[ShardedModel, Comm, Plan, int, int, int], None]


class Controls:
    """The honest worker's controls. A subclass overrides the hooks it needs; the names below are
    what the worker writes into its audit log's manifest (and the masked mode chooses its member
    from: masked/controls.py)."""

    variant: str = "sharded"  # "megatron": the replicated-residual baseline
    leak: str | None = None  # the --inject-leak spec, as given
    fault: str | None = None  # the --inject-fault spec, as given

    def opened(self, config: ModelConfig) -> None:
        """The model file is open (before joining): a spec that does not fit it fails here."""

    def join(self, join: Callable) -> Callable:
        """The join the worker uses for later epochs (comm.join_epoch, or a faulty one's)."""
        return join

    def comm(self, comm: Comm) -> Comm:
        """Each epoch's Comm as the worker uses it: as is, or a faulty or leaky one's."""
        return comm

    def model_class(self) -> type[ShardedModel]:
        """What the worker loads its share into (the same constructor and protocol for every one)."""
        return ShardedModel

    def arm(self, model: ShardedModel) -> None:
        """After each handshake's load and reset: compose a leak onto the model (nothing here)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(variant={self.variant!r}, leak={self.leak!r}, fault={self.fault!r})"
