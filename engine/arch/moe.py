"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, GLM-4.5, DeepSeek-V2/V3,
GLM-4.7-Flash, ERNIE 4.5 MoE): a router picks k experts per token.

out[t] = sum over the k experts e with the largest router logits of w[t, e] * down_e(silu(gate_e h) * up_e h)
with w = softmax over all experts' logits, taken at the chosen ones and (norm_topk_prob) renormalized to
sum 1, as transformers computes it (Mixtral's and gpt-oss's "softmax over the top k" is the same numbers).
gpt-oss adds a bias to the router and to each expert's three matrices, and its own activation
(LlamaConfig.expert_act). Qwen2-MoE adds a shared expert every token runs, a dense SwiGLU FFN whose output
is scaled by sigmoid(shared_gate . h) and added to the routed experts' sum. GLM-4.5 routes by sigmoid
scores instead of a softmax: the k largest of score + a per-expert bias are chosen, weighted by their scores
(renormalized) times a constant, and its shared expert is ungated. DeepSeek-V2 routes by softmax and
DeepSeek-V3 (and GLM-4.7-Flash) as GLM-4.5, both optionally among the best groups of experts only (route).
ERNIE 4.5 MoE routes by softmax with a per-expert bias added to the probabilities for the choice only (its
moe_statics.e_score_correction_bias), renormalizes, and adds ungated shared experts.

Each expert is an ordinary weight matrix (a row block of the file's (experts, rows, cols) tensor, still
in its quantized format), so every weight type the engine computes with works here. Tokens are grouped by
expert: an expert's three matrices run once on all the tokens routed to it (prefill: each expert on its
share of the prompt), and only chosen experts' pages are read. A one-token step over a GGUF's merged
expert tensors runs the k experts' gate, up and down matrices as one pass each (cpu.linear_experts),
with the bits the expert-by-expert path gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.backends import cpu as ops
from engine.errors import MissingTensorError
from engine.weights import Weight


@dataclass
class MoE:
    """A layer's experts: router (experts, hidden); per expert gate, up (ff, hidden) and down (hidden, ff)."""

    router: Weight
    gate: list[Weight]
    up: list[Weight]
    down: list[Weight]
    # the merged (experts * rows, cols) tensors the experts are row blocks of, when the file has them and
    # cpu.linear_experts takes their types (GGUF); None: expert by expert
    stacks: tuple[Weight, Weight, Weight] | None = None
    # biases (gpt-oss): router (experts,), gate and up (experts, ff), down (experts, hidden); None: none
    router_bias: np.ndarray | None = None
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
    # the shared expert (Qwen2-MoE): gate, up (shared_ff, hidden) and down (hidden, shared_ff), and its
    # gate's weight vector (hidden,); None: none
    shared: tuple[Weight, Weight, Weight] | None = None
    shared_gate: np.ndarray | None = None  # None with a shared expert: ungated (GLM-4.5)
    # a per-expert bias added to the scores for the choice only (GLM-4.5's e_score_correction_bias, to the
    # sigmoid scores; ERNIE 4.5 MoE's, to the softmax probabilities), (experts,); None: none
    score_bias: np.ndarray | None = None
    # Gemma 4's per-expert multiplier of the routing weights (router.per_expert_scale), (experts,); None: none
    expert_scale: np.ndarray | None = None
    # stacks[0] is the merged gate|up tensor (experts * 2ff rows: each expert's gate rows then its up rows, as
    # Gemma 4 keeps them) and stacks[1] the same tensor
    gate_up_stacked: bool = False

    def weights(self) -> list[Weight]:
        return [self.router, *self.gate, *self.up, *self.down, *(self.shared or ())]


def load_moe(weights, p: str, n_experts: int, ff: int, d: int, shared_ff: int = 0) -> MoE:
    """The experts of layer prefix p ("blk.N.") from a weight source with matrix() and experts() (and
    expert_stack(), where the source keeps merged expert tensors); shared_ff: the shared expert's
    intermediate size (0: none). Each expert's gate and up rows may share one tensor, ffn_gate_up_exps
    (Gemma 4's, and Granite 4.0's input_linear as HF keeps it), and a shared expert's one ffn_up_shexp
    (Granite 4.0's shared_mlp)."""
    shapes = {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}
    stacker = getattr(weights, "expert_stack", lambda *a: None)
    merged = p + "ffn_gate_up_exps.weight"

    def bias(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        return weights.floats(p + name, shape) if weights.has(p + name) else None

    if weights.has(merged):
        both = weights.experts(merged, n_experts, 2 * ff, d)
        experts = {"gate": [w.row_block(0, ff) for w in both], "up": [w.row_block(ff, 2 * ff) for w in both]}
        gate_up = stacker(merged, n_experts, 2 * ff, d)
        stacks = (gate_up, gate_up, stacker(p + "ffn_down_exps.weight", n_experts, d, ff))
    else:
        experts = {k: weights.experts(f"{p}ffn_{k}_exps.weight", n_experts, *s) for k, s in shapes.items()
                   if k != "down"}
        stacks = tuple(stacker(f"{p}ffn_{k}_exps.weight", n_experts, *s) for k, s in shapes.items())
    moe = MoE(
        router=weights.matrix(p + "ffn_gate_inp.weight", n_experts, d),
        gate=experts["gate"],
        up=experts["up"],
        down=weights.experts(p + "ffn_down_exps.weight", n_experts, d, ff),
        router_bias=bias("ffn_gate_inp.bias", (n_experts,)),
        score_bias=_expert_vector(weights, p + "exp_probs_b.bias", n_experts),
        **{f"{k}_bias": bias(f"ffn_{k}_exps.bias", (n_experts, s[0])) for k, s in shapes.items()},
        gate_up_stacked=weights.has(merged),
    )
    if all(w is not None and ops.gathers_experts(w) for w in stacks):
        moe.stacks = stacks
    if shared_ff:
        if weights.has(p + "ffn_gate_shexp.weight"):
            gate = weights.matrix(p + "ffn_gate_shexp.weight", shared_ff, d)
            up = weights.matrix(p + "ffn_up_shexp.weight", shared_ff, d)
        else:  # gate rows, then up rows
            fused = weights.matrix(p + "ffn_up_shexp.weight", 2 * shared_ff, d)
            gate, up = fused.row_block(0, shared_ff), fused.row_block(shared_ff, 2 * shared_ff)
        moe.shared = (gate, up, weights.matrix(p + "ffn_down_shexp.weight", d, shared_ff))
        gate = p + "ffn_gate_inp_shexp.weight"
        moe.shared_gate = _shared_gate(weights, gate, d) if weights.has(gate) else None
    return moe


def _expert_vector(weights, name: str, n_experts: int) -> np.ndarray | None:
    """A per-expert vector (n_experts,) of tensor `name`, None when absent; ERNIE 4.5 MoE's folders keep its
    choice bias as (1, experts), and so may a GGUF that did not squeeze it."""
    if not weights.has(name):
        return None
    try:
        return weights.floats(name, (n_experts,))
    except MissingTensorError:  # a shape mismatch: the other layout
        return weights.floats(name, (1, n_experts)).reshape(n_experts)


def _shared_gate(weights, name: str, d: int) -> np.ndarray:
    """The shared expert's gate vector (d,) of tensor `name` (present): HF's (1, hidden) Linear, which GGUFs
    keep as (1, d) or (d,)."""
    try:
        return weights.floats(name, (1, d)).reshape(d)
    except MissingTensorError:  # a shape mismatch: the other layout
        return weights.floats(name, (d,))


# ERNIE 4.5 MoE's moe_norm_min (its config's default, which GGUF has no key for): the least sum its chosen
# experts' probabilities are divided by
_NORM_MIN = 1e-12


def route(
    logits: np.ndarray, k: int, normalize: bool, sigmoid: bool = False, bias: np.ndarray | None = None,
    scale: float = 1.0, groups: int = 1, groups_used: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(experts (n, k) int64, weights (n, k) float32) from router logits (n, experts).

    Softmax routing: the k largest logits of each token (ties: the lower index first) and their softmax
    probabilities (renormalized over the k when `normalize`); with a bias (ERNIE 4.5 MoE) the k largest of
    probability + bias, weighted by their probabilities, renormalized by a sum held at least _NORM_MIN.
    Sigmoid routing (GLM-4.5, DeepSeek-V3): the k largest of sigmoid(logit) + bias, weighted by their sigmoid
    scores (renormalized when `normalize`). Either way the weights are then multiplied by `scale`.

    Group-limited routing (DeepSeek's n_group / topk_group): the experts come in `groups` equal groups and
    only the `groups_used` best groups of a token are chosen from: by their largest probability under a
    softmax (DeepSeek-V2's group_limited_greedy), by the sum of their two largest biased scores under a
    sigmoid (DeepSeek-V3's noaux_tc), as transformers computes them; 0 or `groups` used: no limit."""
    limited = groups > 1 and 0 < groups_used < groups
    if limited and logits.shape[1] % groups:
        raise ValueError(f"{logits.shape[1]} experts do not split into {groups} groups")
    if sigmoid:
        scores = _sigmoid(logits)
        choice = scores if bias is None else scores + bias
        if limited:
            choice = _limit_groups(choice, groups, groups_used, top2=True, fill=-np.inf)
        top = np.argsort(-choice, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(scores, top, axis=1)
        if normalize:
            w = w / (w.sum(axis=1, keepdims=True) + np.float32(1e-20))
    elif bias is not None:
        if limited:
            raise ValueError("group-limited softmax routing with a choice bias is not supported")
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z, dtype=np.float32)
        p /= p.sum(axis=1, keepdims=True)
        top = np.argsort(-(p + bias), axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(p, top, axis=1)
        if normalize:  # transformers' Ernie4_5_MoeTopKRouter: the sum clamped at moe_norm_min
            w = w / np.maximum(w.sum(axis=1, keepdims=True), np.float32(_NORM_MIN))
    else:
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z, dtype=np.float32)
        # the k largest logits are the k largest probabilities; a group limit zeroes the groups left out
        choice = _limit_groups(p, groups, groups_used, top2=False, fill=0.0) if limited else logits
        top = np.argsort(-choice, axis=1, kind="stable")[:, :k]
        chosen = np.take_along_axis(p, top, axis=1)
        total = chosen.sum(axis=1, keepdims=True) if normalize else p.sum(axis=1, keepdims=True)
        w = chosen / total
    if scale != 1.0:
        w = w * np.float32(scale)
    return top, w.astype(np.float32)


def _limit_groups(choice: np.ndarray, groups: int, used: int, top2: bool, fill: float) -> np.ndarray:
    """choice (n, experts) with the experts outside each token's `used` best groups set to `fill`; a group's
    score is its largest entry, or (top2) the sum of its two largest."""
    n, n_experts = choice.shape
    grouped = choice.reshape(n, groups, n_experts // groups)
    best = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2) if top2 else grouped.max(axis=2)
    keep = np.argsort(-best, axis=1, kind="stable")[:, :used]
    mask = np.zeros((n, groups), bool)
    np.put_along_axis(mask, keep, True, axis=1)
    return np.where(np.repeat(mask, n_experts // groups, axis=1), choice, np.float32(fill))


def moe_forward(out: np.ndarray, h: np.ndarray, moe: MoE, cfg, router_h: np.ndarray | None = None) -> None:
    """out (n, hidden) = the MoE block applied to the normed hidden states h (n, hidden); cfg: a
    LlamaConfig (num_experts_per_tok, norm_topk_prob, expert_gating, expert_weights_scale, expert_groups,
    expert_groups_used, expert_act) or
    Gemma4Config; router_h: what the router reads when it is not h (Gemma 4: its own norm of the residual)."""
    n = h.shape[0]
    logits = np.empty((n, len(moe.gate)), np.float32)
    ops.linear(logits, moe.router, h if router_h is None else router_h)
    if moe.router_bias is not None:
        logits += moe.router_bias
    experts, w = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.expert_gating == "sigmoid",
                       moe.score_bias, cfg.expert_weights_scale, getattr(cfg, "expert_groups", 1),
                       getattr(cfg, "expert_groups_used", 0))
    if moe.expert_scale is not None:
        w = w * moe.expert_scale[experts]
    if n == 1 and moe.stacks is not None:
        _one_token(out, h, moe, experts[0], w[0], cfg)
    else:
        _grouped(out, h, moe, experts, w, cfg)
    if moe.shared is not None:
        _add_shared(out, h, moe)


def _add_shared(out: np.ndarray, h: np.ndarray, moe: MoE) -> None:
    # out += down(silu(gate h) * up h), times sigmoid(h . shared_gate) where gated (Qwen2-MoE)
    gate_w, up_w, down_w = moe.shared
    n = h.shape[0]
    gate = np.empty((n, gate_w.rows), np.float32)
    up = np.empty((n, gate_w.rows), np.float32)
    ops.linear(gate, gate_w, h)
    ops.linear(up, up_w, h)
    ops.silu_mul(gate, gate, up)
    y = np.empty_like(out)
    ops.linear(y, down_w, gate)
    if moe.shared_gate is None:  # GLM-4.5: ungated
        out += y
        return
    # a row's gate logit in one fixed order, alone or in a batch (BLAS's gemv may not keep it)
    logit = (h * moe.shared_gate).sum(axis=1, dtype=np.float32)
    out += _sigmoid(logit)[:, None] * y


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


def _grouped(out: np.ndarray, h: np.ndarray, moe: MoE, experts: np.ndarray, w: np.ndarray, cfg) -> None:
    # tokens grouped by expert: each chosen expert's three matrices once, on all the tokens routed to it
    n = h.shape[0]
    out[:] = 0.0
    ff = moe.gate[0].rows
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)
        x = h if n == 1 else np.ascontiguousarray(h[rows])
        gate = np.empty((len(rows), ff), np.float32)
        up = np.empty((len(rows), ff), np.float32)
        ops.linear(gate, moe.gate[e], x)
        ops.linear(up, moe.up[e], x)
        _activate(gate, up, moe, np.array([e]), cfg)
        y = np.empty((len(rows), out.shape[1]), np.float32)
        ops.linear(y, moe.down[e], gate)
        if moe.down_bias is not None:
            y += moe.down_bias[e]
        out[rows] += w[rows, slot][:, None] * y


def _activate(gate: np.ndarray, up: np.ndarray, moe: MoE, experts: np.ndarray, cfg) -> None:
    """gate (m, ff) = the activation of gate and up (m, ff), rows of experts `experts` (one for all rows,
    or one a row), their biases added first."""
    if moe.gate_bias is not None:
        gate += moe.gate_bias[experts]
        up += moe.up_bias[experts]
    if cfg.expert_act == "swiglu_oai":
        ops.swiglu_oai_mul(gate, gate, up, cfg.swiglu_alpha, cfg.swiglu_limit)
    elif cfg.expert_act == "gelu_tanh":  # Gemma 4
        ops.gelu_tanh_mul(gate, gate, up)
    else:
        ops.silu_mul(gate, gate, up)


def _one_token(out: np.ndarray, h: np.ndarray, moe: MoE, experts: np.ndarray, w: np.ndarray, cfg) -> None:
    # one token's k experts over the merged tensors: gate, up and down each one pass (cpu.linear_experts)
    gate_all, up_all, down_all = moe.stacks
    ff, d = moe.gate[0].rows, out.shape[1]
    k = len(experts)
    gate = np.empty((k, ff), np.float32)
    up = np.empty((k, ff), np.float32)
    gate_rows = experts * (2 * ff if moe.gate_up_stacked else ff)
    ops.linear_experts(gate, gate_all, h, gate_rows, ff)
    ops.linear_experts(up, up_all, h, gate_rows + ff if moe.gate_up_stacked else gate_rows, ff)
    _activate(gate, up, moe, experts, cfg)
    y = np.empty((k, d), np.float32)
    ops.linear_experts(y, down_all, gate, experts * d, d)
    if moe.down_bias is not None:
        y += moe.down_bias[experts]
    out[:] = 0.0
    for j in np.argsort(experts):  # the grouped path's sum, in its order (experts by id): the same bits
        out[0] += w[j] * y[j]
