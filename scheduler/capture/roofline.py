"""Node times from a device's specification, without running anything (``times="roofline"``).

Each op takes ``max(flops / peak FLOP/s, bytes / bandwidth) + per_op_s``: its floating-point
work (`op_counter.OpCounter`, ``torch.utils.flop_counter``'s formulas for matmuls, convolutions and
attention) at the device's peak rate for the op's dtype, or the bytes it reads and writes at
the device's memory bandwidth, whichever is longer, plus a fixed cost per op (a kernel
launch, the dispatcher). A node's time is the sum over its ops. This is an estimate: it ranks
matmul-heavy regions against elementwise ones, which is what the solver compares, but it
knows nothing of fusion, caches or how well a kernel reaches the peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["DEVICE_SPECS", "DeviceSpec", "device_spec", "local_spec", "roofline_s", "work_s"]


@dataclass(frozen=True)
class DeviceSpec:
    """What a device can do at best.

    Args:
        name: a label, e.g. ``"h100"``.
        flops: peak dense FLOP/s for matmul-like ops in half precision (bf16/fp16).
        flops_fp32: peak FLOP/s in fp32 (TF32 tensor cores where the device has them).
        bandwidth: memory bandwidth in bytes per second.
        per_op_s: fixed seconds per op (kernel launch and dispatch).
    """

    name: str
    flops: float
    flops_fp32: float
    bandwidth: float
    per_op_s: float = 5e-6

    def __post_init__(self) -> None:
        for f in ("flops", "flops_fp32", "bandwidth"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v > 0 and v != float("inf")):
                raise ValueError(f"DeviceSpec.{f} must be a positive finite number, got {v!r}")
        if not (isinstance(self.per_op_s, (int, float)) and 0 <= self.per_op_s < 1):
            raise ValueError(f"DeviceSpec.per_op_s must be in [0, 1) seconds, got "
                             f"{self.per_op_s!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: published dense peaks (no sparsity) of common training devices; per_op_s is a typical
#: launch cost. CPU numbers vary by machine: pass your own `DeviceSpec` for one.
DEVICE_SPECS: dict[str, DeviceSpec] = {
    "a100": DeviceSpec("a100", flops=312e12, flops_fp32=156e12, bandwidth=2.0e12),
    "h100": DeviceSpec("h100", flops=989e12, flops_fp32=494e12, bandwidth=3.35e12),
    "h200": DeviceSpec("h200", flops=989e12, flops_fp32=494e12, bandwidth=4.8e12),
    "l4": DeviceSpec("l4", flops=121e12, flops_fp32=60e12, bandwidth=0.3e12),
    "cpu": DeviceSpec("cpu", flops=1e11, flops_fp32=5e10, bandwidth=2e10, per_op_s=2e-5),
}


def device_spec(spec: "str | DeviceSpec | None") -> DeviceSpec:
    """A `DeviceSpec` by name (`DEVICE_SPECS`), or the one given.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(spec, DeviceSpec):
        return spec
    if spec is None:
        raise ValueError("times='roofline' needs a device spec: device_spec='h100' (one of "
                         f"{sorted(DEVICE_SPECS)}) or a scheduler.DeviceSpec(...)")
    got = DEVICE_SPECS.get(str(spec).lower())
    if got is None:
        raise ValueError(f"unknown device spec {spec!r}; use one of {sorted(DEVICE_SPECS)} or "
                         f"pass a scheduler.DeviceSpec(name, flops=, flops_fp32=, bandwidth=)")
    return got


def roofline_s(spec: DeviceSpec, ops: list[tuple[int, int, bool]]) -> float:
    """Seconds for ``ops``, each ``(flops, bytes, half_precision)``, on ``spec``."""
    total = 0.0
    for flops, nbytes, half in ops:
        rate = spec.flops if half else spec.flops_fp32
        total += max(flops / rate, nbytes / spec.bandwidth) + spec.per_op_s
    return total


def local_spec(device: Any) -> DeviceSpec:
    """The device spec whose rates weigh ops against each other on ``device``: `DEVICE_SPECS`'
    ``"h100"`` for CUDA, ``"cpu"`` otherwise. Only ratios of its roofline times are used (how
    a node's time splits over its backward steps, how a node's time grows with its work), so
    the exact numbers of the machine matter little; their FLOP/s-to-bandwidth balance does."""
    return DEVICE_SPECS["h100" if device.type == "cuda" else "cpu"]


def work_s(spec: DeviceSpec, ops: list[tuple[int, int, bool]]) -> float:
    """Roofline seconds of ``ops`` on ``spec`` without the per-op constant: the part of an
    op's time that grows with its FLOPs and bytes."""
    return roofline_s(dataclasses.replace(spec, per_op_s=0.0), ops)
