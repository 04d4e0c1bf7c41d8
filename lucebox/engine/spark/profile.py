"""The placement profile: routing counts per (layer, expert) from calibration traffic, and what they came from.

A profile is a JSON file (`FORMAT`, version 1):

    format, version            "lucebox.spark.profile", 1
    layout                     the model it was calibrated on: arch, num_layers, moe_layers (layer ids),
                               n_experts, top_k, hidden, expert_ff, expert_bytes (per MoE layer, as held
                               when calibrating), quant (gate/up/down storage as held), file_quant (the
                               file's dominant weight type: another quant of the model is served with a
                               warning)
    layout_id                  sha256 (16 hex) of the routing structure (arch, layers, experts, top_k, sizes):
                               a profile only serves a model of the same layout_id. How the experts are
                               held (expert_bytes, quant: dense on a CPU, blocks on a GPU) is recorded but
                               not part of it: serving sizes the hot set from its own bytes
    router_fingerprint         sha256 (16 hex) of the first MoE layer's router weights rounded to bf16: another
                               checkpoint of the same layout is served with a warning (re-calibrate)
    router_skew                null, or the `zipf:S` simulation the counts were measured under
    model                      the path calibrated on
    traffic                    per file: file (name), sha256, conversations and tokens, train and held-out
    decode_tokens              decoded tokens counted per conversation after its prefill
    heldout_every              every N-th conversation was held out (0: none)
    max_prompt_tokens          longer prompts were cut to this
    routed                     routed (token, expert) pairs counted, {train, heldout}
    counts, heldout_counts     {layer: [routed pairs per expert]}, the training split and the held-out one
    placement                  the hot set chosen for the calibration budget: budget, budget_bytes, budget_gb,
                               expert_bytes_total, hot {layer: [experts]}, hot_experts, experts
    predicted_cold_hit_rate    held-out pairs whose expert is not hot (calibrated placement, no ring); null
                               without held-out conversations
    uniform_cold_hit_rate      the same for the uniform placement of the same budget
    train_cold_hit_rate        the calibrated placement's rate on its own training counts

Serving re-derives the hot set from `counts` for its own budget and expert sizes (quantized or not, a
ring or not), so one profile serves any budget.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from lucebox.engine.models.moe import MoE
from lucebox.errors import LuceboxError

FORMAT = "lucebox.spark.profile"
VERSION = 1
STRUCTURE = ("arch", "num_layers", "moe_layers", "n_experts", "top_k", "hidden", "expert_ff")


def moe_layers(model: torch.nn.Module) -> dict[int, MoE]:
    """The model's MoE modules by layer id."""
    out = {}
    for block in model.blk:  # type: ignore[union-attr]
        moe = getattr(block, "moe", None)
        if moe is not None:
            out[moe.layer] = moe
    if not out:
        raise LuceboxError("Spark needs a mixture-of-experts model; this one has no MoE layers")
    return out


def expert_bytes(moe: MoE) -> int:
    """One expert's bytes as held (its rows of gate, up and down; quantized blocks or dense)."""
    total = 0
    for lin, rows in ((moe.ffn_gate_exps, moe.ff), (moe.ffn_up_exps, moe.ff), (moe.ffn_down_exps, moe.hidden)):
        t = lin.qdata if lin.qtype is not None else lin.weight
        total += rows * t.shape[1] * t.element_size()
    return total


def storage_type(moe: MoE) -> str:
    """gate/up/down storage, e.g. `Q4_K/Q4_K/Q6_K` or `F32/F32/F32`."""
    names = []
    for lin in (moe.ffn_gate_exps, moe.ffn_up_exps, moe.ffn_down_exps):
        names.append(lin.qtype or str(lin.weight.dtype).removeprefix("torch.").replace("float", "F").upper())
    return "/".join(names)


def layout(model: torch.nn.Module, arch: str, file_quant: str) -> dict[str, Any]:
    """The model's layout as a profile records it (`file_quant`: the file's dominant weight type)."""
    layers = moe_layers(model)
    first = next(iter(layers.values()))
    return {"arch": arch, "num_layers": len(model.blk), "moe_layers": sorted(layers),  # type: ignore[arg-type]
            "n_experts": first.n_experts, "top_k": first.top_k, "hidden": first.hidden, "expert_ff": first.ff,
            "expert_bytes": {str(i): expert_bytes(m) for i, m in layers.items()}, "quant": storage_type(first),
            "file_quant": file_quant}


def layout_id(lay: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({k: lay[k] for k in STRUCTURE}, sort_keys=True).encode()).hexdigest()[:16]


def router_fingerprint(model: torch.nn.Module) -> str:
    moe = next(iter(moe_layers(model).values()))
    w = moe.ffn_gate_inp.weight.detach().float().to(torch.bfloat16).cpu().contiguous()
    return hashlib.sha256(w.view(torch.int16).numpy().tobytes()).hexdigest()[:16]


class RouteCounter:
    """Counts routed (token, expert) pairs per layer on the device (no host sync): set as each MoE's
    `route_counter` while calibrating (`attach`), None otherwise, which costs the forward one attribute test."""

    def __init__(self, layers: dict[int, MoE], device: torch.device) -> None:
        self.layers = layers
        n_experts = next(iter(layers.values())).n_experts
        self.counts = torch.zeros(max(layers) + 1, n_experts, dtype=torch.int64, device=device)

    def __call__(self, layer: int, ids: torch.Tensor) -> None:
        flat = ids.reshape(-1)
        self.counts[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))

    def attach(self) -> None:
        for moe in self.layers.values():
            moe.route_counter = self

    def detach(self) -> None:
        for moe in self.layers.values():
            moe.route_counter = None

    def take(self) -> dict[int, list[int]]:
        """The counts so far, per MoE layer, and reset them."""
        rows = self.counts.cpu().tolist()
        self.counts.zero_()
        return {layer: rows[layer] for layer in sorted(self.layers)}


def write_profile(path: Path, body: dict[str, Any]) -> None:
    """Write `body` (a profile without its format keys) as the JSON file `path`."""
    doc = {"format": FORMAT, "version": VERSION, **body}
    try:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise LuceboxError(f"--out {path}: {exc.strerror or exc}") from None


def read_profile(path: Path) -> dict[str, Any]:
    """A profile file's contents, checked for the keys serving reads; counts keyed by int layer."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise LuceboxError(f"--spark {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LuceboxError(f"--spark {path}: not a JSON file (a profile from `python -m lucebox spark "
                           "calibrate`)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise LuceboxError(f"--spark {path}: not a Spark profile (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise LuceboxError(f"--spark {path}: profile version {doc.get('version')!r}, this Lucebox reads {VERSION}")
    try:
        lay = doc["layout"]
        counts = {int(k): [int(c) for c in v] for k, v in doc["counts"].items()}
        heldout = {int(k): [int(c) for c in v] for k, v in (doc.get("heldout_counts") or {}).items()}
        if any(len(v) != lay["n_experts"] or min(v, default=0) < 0 for v in [*counts.values(), *heldout.values()]):
            raise ValueError("counts")
        if heldout and sorted(heldout) != sorted(counts):
            raise ValueError("heldout")
        if sorted(counts) != sorted(lay["moe_layers"]) or doc["layout_id"] != layout_id(lay):
            raise ValueError("layout")
    except (KeyError, TypeError, ValueError, AttributeError):
        raise LuceboxError(f"--spark {path}: a damaged profile (its layout or counts do not add up); "
                           "calibrate again") from None
    doc["counts"], doc["heldout_counts"] = counts, heldout
    return doc


def check_profile(doc: dict[str, Any], model: torch.nn.Module, arch: str, file_quant: str, path: Path) -> list[str]:
    """Raise when the profile was calibrated on another layout; the warnings to log otherwise."""
    ours = layout(model, arch, file_quant)
    if doc["layout_id"] != layout_id(ours):
        diff = next(k for k in STRUCTURE if doc["layout"].get(k) != ours[k])
        raise LuceboxError(f"--spark {path} was calibrated on another model: its {diff} is "
                           f"{doc['layout'].get(diff)!r}, this model's {ours[diff]!r} (calibrate on this model)")
    warnings = []
    if doc["layout"].get("file_quant") != file_quant:
        warnings.append(f"--spark {path} was calibrated on a {doc['layout'].get('file_quant')} file, this one is "
                        f"{file_quant}: the routing of other weights differs a little; calibrate on this file")
    elif doc.get("router_fingerprint") != router_fingerprint(model):
        warnings.append(f"--spark {path} was calibrated on other weights of this layout (router fingerprint "
                        "differs): its placement may not fit this model's routing; calibrate again")
    return warnings
