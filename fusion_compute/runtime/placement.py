"""Where a job's tensors live and in what dtype: `--device`, `--dtype`, `--client-device`.

A worker's weights, KV cache and every step's tensors live on its device (`cpu`, `cuda` or `cuda:K`),
in the job's dtype (`float32`, `bfloat16` or `float16`), placed once at load; the wire carries that
dtype. The names and their syntax are checked here without torch (the command line refuses a bad
value before torch loads); `check_gpus` asks torch what this machine has, before any worker starts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..errors import UsageError

# the compute dtypes, and their bytes per element on the wire
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_DTYPE = "float32"
_DEVICE = re.compile(r"^(cpu|cuda)(?::([0-9]+))?$")


def parse_device(device: str, what: str = "--device") -> tuple[str, int | None]:
    """ "cpu" -> ("cpu", None), "cuda" -> ("cuda", None), "cuda:1" -> ("cuda", 1); anything else is refused."""
    m = _DEVICE.match(device or "")
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise UsageError(f"{what} must be cpu, cuda or cuda:K, got {device!r}")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def is_cuda(device: str | None) -> bool:
    return bool(device) and parse_device(str(device))[0] == "cuda"


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def itemsize(dtype: str) -> int:
    """Bytes per element of `dtype` (a DTYPES name) on the wire."""
    return DTYPES[dtype]


def torch_dtype(dtype: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def gpu_count() -> int:
    """The GPUs torch sees here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(devices: Sequence[str], gpus: int, what: str = "--device") -> None:
    """Refuse a CUDA device this machine does not have: UsageError, one line (exit 2)."""
    for device in devices:
        kind, index = parse_device(device, what)
        if kind != "cuda":
            continue
        if gpus == 0:
            raise UsageError(f"{what} {device}: torch sees no GPU on this machine (no CUDA device); use --device cpu")
        if index is not None and index >= gpus:
            raise UsageError(f"{what} {device}: this machine has {gpus} GPU(s), cuda:0..cuda:{gpus - 1}")


def local_devices(device: str, n: int, gpus: int) -> list[str]:
    """The device of each of n local workers: "cuda" spreads them over the GPUs in turn (several share
    one when there are fewer GPUs than workers), "cuda:K" puts them all on GPU K, "cpu" on the CPU."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return ["cpu"] * n
    if index is not None:
        return [f"cuda:{index}"] * n
    return [f"cuda:{i % max(1, gpus)}" for i in range(n)]
