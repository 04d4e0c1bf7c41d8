"""Which experts live on the device: the hot set for a byte budget, from calibrated counts or uniform.

The budget is what the experts may take on the device, the per-layer rings' slots included (a ring slot
holds one expert, so a ring of R slots in each of L layers costs R * L experts' bytes of the hot set).
`calibrated` picks, across all layers at once, the experts that served the most routed (token, expert)
pairs per byte in the calibration traffic: with every expert of a layer the same size this minimises the
calibration traffic's cold hits for the budget. `uniform` is the placement without calibration: the same
number of experts in every layer, the lowest ids (what a placement that knows nothing of the routing does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lucebox.errors import LuceboxError

GB = 1 << 30


@dataclass(frozen=True)
class Budget:
    """`--expert-gpu-budget`: GB (2^30 bytes) of expert weights on the device, or a fraction of them."""

    gb: float | None = None
    fraction: float | None = None

    @staticmethod
    def parse(text: str | float) -> Budget:
        """`12` or `12GB` is 12 GB; `60%` is 60% of the model's expert bytes."""
        raw = str(text).strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(%|gb|g|gib)?", raw, flags=re.IGNORECASE)
        if not m:
            raise LuceboxError(f"--expert-gpu-budget must be GB (12, 12GB) or a percentage of the expert "
                               f"bytes (60%), got {raw!r}")
        value = float(m.group(1))
        if m.group(2) == "%":
            if not 0 <= value <= 100:
                raise LuceboxError(f"--expert-gpu-budget {raw}: a percentage must be in [0, 100]")
            return Budget(fraction=value / 100)
        return Budget(gb=value)

    def bytes(self, total_expert_bytes: int) -> int:
        if self.fraction is not None:
            return int(self.fraction * total_expert_bytes)
        return int(self.gb * GB)  # type: ignore[operator]

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%" if self.fraction is not None else f"{self.gb:g}GB"


def hot_budget(budget_bytes: int, expert_bytes: dict[int, int], ring_slots: int) -> int:
    """What the budget leaves for the hot set once every layer's ring is paid for."""
    left = budget_bytes - ring_slots * sum(expert_bytes.values())
    if left < 0:
        raise LuceboxError(f"the expert budget ({budget_bytes / GB:.2f} GB) does not hold {ring_slots} ring "
                           f"slot(s) in each of the {len(expert_bytes)} MoE layers "
                           f"({ring_slots * sum(expert_bytes.values()) / GB:.2f} GB): lower --spark-ring")
    return left


def calibrated(counts: dict[int, list[int]], expert_bytes: dict[int, int], budget_bytes: int) -> dict[int, list[int]]:
    """The experts serving the most calibration pairs per byte, across layers, while they fit the budget
    (ties: lower layer, then lower id, so a profile gives one placement)."""
    ranked = sorted(((layer, e) for layer, row in counts.items() for e in range(len(row))),
                    key=lambda le: (-counts[le[0]][le[1]] / expert_bytes[le[0]], le[0], le[1]))
    hot: dict[int, list[int]] = {layer: [] for layer in counts}
    left = budget_bytes
    for layer, e in ranked:
        if expert_bytes[layer] <= left:
            hot[layer].append(e)
            left -= expert_bytes[layer]
    return {layer: sorted(v) for layer, v in hot.items()}


def uniform(n_experts: int, expert_bytes: dict[int, int], budget_bytes: int) -> dict[int, list[int]]:
    """The same count of experts in every layer (ids 0..m-1), one more in the first layers the rest pays for."""
    per_all = sum(expert_bytes.values())
    m = min(n_experts, budget_bytes // per_all if per_all else 0)
    hot = {layer: list(range(m)) for layer in expert_bytes}
    left = budget_bytes - m * per_all
    for layer, size in expert_bytes.items():
        if m < n_experts and size <= left:
            hot[layer].append(m)
            left -= size
    return hot


def cold_hit_rate(counts: dict[int, list[int]], hot: dict[int, list[int]]) -> float | None:
    """The share of routed pairs in `counts` whose expert is not in `hot` (None when nothing was routed)."""
    total = sum(sum(row) for row in counts.values())
    if not total:
        return None
    served = sum(counts[layer][e] for layer, experts in hot.items() for e in experts)
    return 1.0 - served / total
