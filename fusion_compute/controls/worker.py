"""The structural worker's controls from its flags (`--inject-fault`, `--inject-leak`, `--variant`):
the honest Controls when none is given, else a Chosen one whose hooks compose the fault onto each
epoch's Comm and join (runtime/faults.py), the leak onto the loaded model (audit/inject.py), and
load the Megatron-style model for the baseline. The masked mode reads the same specs and picks its
own dishonest member (masked/controls.py)."""

from __future__ import annotations

from collections.abc import Callable

from ..audit.inject import install_leak, parse_leak
from ..comm import Comm
from ..model.config import ModelConfig
from ..runtime.faults import comm_fault, parse_fault, rejoin
from ..structural.controls import Controls
from ..structural.megatron import MegatronModel
from ..structural.sharded import ShardedModel

VARIANTS = ("sharded", "megatron")


class Chosen(Controls):
    """A worker with a control: a fault, a leak, the baseline's model, or several of them."""

    def __init__(self, fault: str | None, leak: str | None, variant: str):
        self.fault, self.leak, self.variant = fault, leak, variant
        self._fault = parse_fault(fault) if fault else None  # a bad spec: one line, before anything opens
        self._on_comm = comm_fault(self._fault)
        if leak and leak != "a-to-b":  # a-to-b: the masked mode's own (masked/controls.py)
            parse_leak(leak)

    def opened(self, config: ModelConfig) -> None:
        if self.leak and self.leak != "a-to-b":
            parse_leak(self.leak, config.n_layers)  # its layer, against the model: before joining

    def join(self, join: Callable) -> Callable:
        return rejoin(self._fault, join)

    def comm(self, comm: Comm) -> Comm:
        return self._on_comm(comm)

    def model_class(self) -> type[ShardedModel]:
        return MegatronModel if self.variant == "megatron" else ShardedModel

    def arm(self, model: ShardedModel) -> None:
        if self.leak:
            install_leak(model, self.leak)


def worker_controls(fault: str | None, leak: str | None, variant: str = "sharded") -> Controls:
    """The controls `fusion worker` runs with: the honest ones unless a flag names one."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: not one of {', '.join(VARIANTS)}")
    if not fault and not leak and variant == "sharded":
        return Controls()
    return Chosen(fault, leak, variant)
