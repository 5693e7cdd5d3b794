"""Mixed bit-width to a budget (`--to mixed:4.5`): measure every tensor under every candidate type, then
pick one type per tensor minimising the total error at the requested average bits per weight.

Error of a tensor under a type: the squared Frobenius norm of (W - dequantize(quantize(W))), divided
by the number of weights and by the tensor's mean square (a relative MSE), times the number of
weights; so each weight's relative error counts once, whatever the tensor's scale. Cost: the type's
bits per weight times the number of weights. Tensors that stay F32 (norms) are outside the budget.

Assignment is a multiple-choice knapsack; it is solved on each tensor's lower convex hull of
(bits, error) points by the Lagrangian method: for a multiplier lam each tensor takes the type
minimising error + lam * bits, lam is bisected to the largest total that fits the budget, then the
remaining bits are spent on the upgrades with the best error decrease per bit. On the convex hulls
this is optimal up to the last (partial) upgrade.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.quant.encode import dequantize, quantize
from engine.quant.presets import (
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    fits,
    is_quantizable,
)
from engine.quant.registry import ProgressFn
from engine.quant.source import SourceModel
from models.errors import HearthError
from models.formats.ggml_types import BLOCK_SIZES, type_name

CANDIDATES_K = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0)
CANDIDATES_32 = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)  # rows that are not a multiple of 256


class BudgetError(HearthError):
    """The mixed budget is missing, not a number, or outside what the candidate types can reach."""


def bits_per_weight(t: int) -> float:
    block, nbytes = BLOCK_SIZES[t]
    return nbytes * 8 / block


def parse_budget(text: str | None) -> float:
    try:
        bpw = float(text)
    except (TypeError, ValueError):
        raise BudgetError(f"mixed needs a bits-per-weight budget, e.g. mixed:4.5 (got {text!r})") from None
    if not 2.0 <= bpw <= 16.0:
        raise BudgetError(f"a bits-per-weight budget of {bpw} is outside 2..16")
    return bpw


def candidates(cols: int) -> tuple[int, ...]:
    return tuple(t for t in (CANDIDATES_K if cols % 256 == 0 else CANDIDATES_32) if fits(t, cols))


def measure(source: SourceModel, progress: ProgressFn) -> dict[str, dict[int, tuple[float, int]]]:
    """name -> {type: (error, n_weights)} for every quantizable tensor whose rows split into some candidate's
    blocks (the others stay F16, as the presets' fallback keeps them)."""
    shapes = source.shapes
    names = [n for n in source.names if is_quantizable(n, shapes[n]) and candidates(shapes[n][-1])]
    out: dict[str, dict[int, tuple[float, int]]] = {}
    for i, name in enumerate(names):
        progress(i, len(names), f"measuring {name}")
        x = source.tensor(name)
        x = x.reshape(-1, x.shape[-1])
        ms = float(np.mean(np.square(x, dtype=np.float64))) or 1.0
        errs = {}
        for t in candidates(x.shape[1]):
            d = dequantize(t, quantize(t, x), x.shape[1])
            errs[t] = (float(np.mean(np.square(d - x, dtype=np.float64))) / ms * x.size, x.size)
        out[name] = errs
    progress(len(names), len(names), "measured")
    return out


@dataclass
class Assignment:
    types: dict[str, int]
    errors: dict[str, float]
    sizes: dict[str, int]
    bpw: float
    budget: float
    options: dict[str, dict[int, tuple[float, int]]] = field(repr=False, default_factory=dict)

    def rows(self) -> list[dict]:
        return [
            {
                "tensor": n,
                "type": type_name(t),
                "bits_per_weight": round(bits_per_weight(t), 4),
                "rel_error": self.errors[n] / self.sizes[n],
            }
            for n, t in self.types.items()
        ]

    def report_lines(self) -> list[str]:
        lines = [f"mixed: {self.bpw:.3f} bits/weight over the quantized matrices (budget {self.budget})"]
        lines += [f"  {r['tensor']:<36} {r['type']:<6} rel.err {r['rel_error']:.3e}" for r in self.rows()]
        return lines


def _hull(opts: dict[int, tuple[float, int]]) -> list[int]:
    """Types on the lower convex hull of (bits, error), by increasing bits."""
    pts = sorted(opts, key=lambda t: (bits_per_weight(t), opts[t][0]))
    hull: list[int] = []
    for t in pts:
        if hull and opts[t][0] >= opts[hull[-1]][0]:
            continue  # more bits, no less error
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            ba, bb, bt = bits_per_weight(a), bits_per_weight(b), bits_per_weight(t)
            ea, eb, et = opts[a][0], opts[b][0], opts[t][0]
            if (eb - ea) * (bt - ba) >= (et - ea) * (bb - ba):  # b above the chord a-t
                hull.pop()
            else:
                break
        hull.append(t)
    return hull


def assign(errors: dict[str, dict[int, tuple[float, int]]], budget: float) -> Assignment:
    """Pick a type per tensor minimising total error with sum(bits) <= budget * sum(weights).

    Raises:
        BudgetError: the budget is below what the smallest candidates take.
    """
    hulls = {n: _hull(o) for n, o in errors.items()}
    sizes = {n: next(iter(o.values()))[1] for n, o in errors.items()}
    total = sum(sizes.values())
    cap = budget * total
    lo_bits = sum(bits_per_weight(h[0]) * sizes[n] for n, h in hulls.items())
    if lo_bits > cap + 1e-6:
        raise BudgetError(
            f"mixed:{budget} is below the {lo_bits / total:.3f} bits/weight the smallest "
            "types need for this model"
        )

    def pick(lam: float) -> dict[str, int]:
        return {
            n: min(h, key=lambda t: errors[n][t][0] + lam * bits_per_weight(t) * sizes[n])
            for n, h in hulls.items()
        }

    def cost(sel: dict[str, int]) -> float:
        return sum(bits_per_weight(t) * sizes[n] for n, t in sel.items())

    lo, hi = 0.0, 1.0
    while cost(pick(hi)) > cap:
        hi *= 4
        if hi > 1e30:
            break
    for _ in range(100):  # smallest lam (most bits) whose choice fits
        mid = (lo + hi) / 2
        if cost(pick(mid)) > cap:
            lo = mid
        else:
            hi = mid
    sel = pick(hi)
    spent = cost(sel)
    # spend what is left on the best error-per-bit upgrades along each hull
    while True:
        best = None
        for n, h in hulls.items():
            i = h.index(sel[n])
            if i + 1 < len(h):
                t, u = sel[n], h[i + 1]
                extra = (bits_per_weight(u) - bits_per_weight(t)) * sizes[n]
                gain = errors[n][t][0] - errors[n][u][0]
                if spent + extra <= cap and (best is None or gain / extra > best[0]):
                    best = (gain / extra, n, u, extra)
        if best is None:
            break
        _, n, u, extra = best
        sel[n] = u
        spent += extra
    return Assignment(
        types=sel,
        errors={n: errors[n][t][0] for n, t in sel.items()},
        sizes=sizes,
        bpw=spent / total,
        budget=budget,
        options=errors,
    )
