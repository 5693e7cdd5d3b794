"""llama.cpp preset rules, fallbacks, the format registry and the mixed bit-width assignment."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.quant import presets, registry
from engine.quant.mixed import BudgetError, assign, bits_per_weight, parse_budget
from engine.quant.presets import F32, Q3_K, Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, plan, use_more_bits


def _shapes(n_layers=8, d=512, ff=1024, tied=True):
    s = {"token_embd.weight": (1000, d)}
    for i in range(n_layers):
        s[f"blk.{i}.attn_norm.weight"] = (d,)
        for n, shape in (
            ("attn_q", (d, d)),
            ("attn_k", (d // 4, d)),
            ("attn_v", (d // 4, d)),
            ("attn_output", (d, d)),
            ("ffn_gate", (ff, d)),
            ("ffn_up", (ff, d)),
            ("ffn_down", (d, ff)),
        ):
            s[f"blk.{i}.{n}.weight"] = shape
    s["output_norm.weight"] = (d,)
    if not tied:
        s["output.weight"] = (1000, d)
    return s


def test_use_more_bits_matches_llamacpp_pattern():
    assert [i for i in range(30) if use_more_bits(i, 30)] == [
        0,
        1,
        2,
        5,
        8,
        11,
        14,
        17,
        20,
        23,
        26,
        27,
        28,
        29,
    ]


def test_q4_k_m_rules():
    p = plan("Q4_K_M", _shapes(tied=False), 8, 4)
    assert p["blk.0.attn_norm.weight"] == F32
    assert p["output.weight"] == Q6_K
    assert p["token_embd.weight"] == Q4_K
    assert p["blk.0.attn_q.weight"] == Q4_K
    more = [i for i in range(8) if use_more_bits(i, 8)]
    for i in range(8):
        want = Q6_K if i in more else Q4_K
        assert p[f"blk.{i}.attn_v.weight"] == want
        assert p[f"blk.{i}.ffn_down.weight"] == want


def test_mixture_of_experts_tensors():
    """llama.cpp matches "ffn_down" anywhere in the name: routed experts' (ffn_down_exps) and a shared
    expert's (ffn_down_shexp) get the extra bits too; routers and the shared expert's one-row gate stay
    F32."""
    d, ff, n_experts = 512, 256, 8
    shapes = {"token_embd.weight": (1000, d)}
    for i in range(8):
        shapes |= {
            f"blk.{i}.ffn_gate_inp.weight": (n_experts, d),
            f"blk.{i}.ffn_gate_exps.weight": (n_experts, ff, d),
            f"blk.{i}.ffn_down_exps.weight": (n_experts, d, ff),
            f"blk.{i}.ffn_gate_shexp.weight": (ff, d),
            f"blk.{i}.ffn_down_shexp.weight": (d, ff),
            f"blk.{i}.ffn_gate_inp_shexp.weight": (1, d),
        }
    p = plan("Q4_K_M", shapes, 8, 4)
    for i in range(8):
        more = Q6_K if use_more_bits(i, 8) else Q4_K
        assert p[f"blk.{i}.ffn_down_exps.weight"] == more and p[f"blk.{i}.ffn_down_shexp.weight"] == more
        assert p[f"blk.{i}.ffn_gate_exps.weight"] == Q4_K and p[f"blk.{i}.ffn_gate_shexp.weight"] == Q4_K
        assert p[f"blk.{i}.ffn_gate_inp.weight"] == F32 and p[f"blk.{i}.ffn_gate_inp_shexp.weight"] == F32


def _moe_shapes(n_experts: int, d: int = 512, ff: int = 256) -> dict[str, tuple[int, ...]]:
    shapes = {"token_embd.weight": (1000, d), "output.weight": (1000, d)}
    for i in range(8):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (d, d),
            f"blk.{i}.attn_k.weight": (d // 4, d),
            f"blk.{i}.attn_v.weight": (d // 4, d),
            f"blk.{i}.attn_output.weight": (d, d),
            f"blk.{i}.ffn_gate_inp.weight": (n_experts, d),
            f"blk.{i}.ffn_up_exps.weight": (n_experts, ff, d),
            f"blk.{i}.ffn_down_exps.weight": (n_experts, d, ff),
        }
    return shapes


def test_mxfp4_moe_puts_experts_in_mxfp4_and_the_rest_in_q8_0():
    p = plan("MXFP4_MOE", _moe_shapes(4), 8, 4, n_experts=4)
    assert p["blk.3.ffn_up_exps.weight"] == presets.MXFP4 and p["blk.3.ffn_down_exps.weight"] == presets.MXFP4
    for name in ("blk.3.attn_q.weight", "blk.3.attn_v.weight", "output.weight", "token_embd.weight"):
        assert p[name] == Q8_0
    assert p["blk.3.ffn_gate_inp.weight"] == F32 and p["blk.3.attn_norm.weight"] == F32
    assert presets.PRESETS["MXFP4_MOE"][1] == 38  # llama.cpp's LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    # rows that do not split into blocks of 32: F16
    odd = plan("MXFP4_MOE", {"blk.0.ffn_down_exps.weight": (4, 64, 48)}, 1, 1, n_experts=4)
    assert odd["blk.0.ffn_down_exps.weight"] == presets.F16


def test_eight_expert_models_get_llama_cpps_attention_bumps():
    """Mixtral (8 experts): attn_k and attn_v Q8_0 in every mix, attn_output Q5_K in Q2_K/Q3_K_M/Q4_K_M;
    other expert counts and the pure formats keep the usual rules."""
    for fmt in ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0"):
        p = plan(fmt, _moe_shapes(8), 8, 4, n_experts=8)
        assert p["blk.4.attn_k.weight"] == Q8_0 and p["blk.4.attn_v.weight"] == Q8_0, fmt
        if fmt in ("Q2_K", "Q3_K_M", "Q4_K_M"):
            assert p["blk.4.attn_output.weight"] == Q5_K, fmt
    assert plan("Q5_K_M", _moe_shapes(8), 8, 4, n_experts=8)["blk.4.attn_output.weight"] == Q5_K  # its base
    assert plan("Q4_K", _moe_shapes(8), 8, 4, n_experts=8)["blk.4.attn_v.weight"] == Q4_K
    p = plan("Q4_K_M", _moe_shapes(4), 8, 4, n_experts=4)
    assert p["blk.4.attn_k.weight"] == Q4_K and p["blk.4.attn_output.weight"] == Q4_K


def test_tied_embedding_gets_output_type_and_q3_k_m():
    p = plan("Q3_K_M", _shapes(n_layers=32), 32, 4)
    assert p["token_embd.weight"] == Q6_K
    assert p["blk.0.attn_v.weight"] == Q5_K and p["blk.2.attn_v.weight"] == Q4_K
    assert p["blk.1.ffn_down.weight"] == Q5_K and p["blk.2.ffn_down.weight"] == Q4_K
    assert p["blk.5.attn_output.weight"] == Q4_K
    assert p["blk.5.attn_q.weight"] == Q3_K


def test_fallback_for_rows_not_multiple_of_256():
    # SmolLM2: 576-wide rows. K-quants fall back as llama.cpp does; the embedding/output goes to Q8_0.
    p = plan("Q4_K_M", _shapes(d=576, ff=1536), 8, 3)
    assert p["token_embd.weight"] == Q8_0
    assert p["blk.3.attn_q.weight"] == Q5_0  # Q4_K -> Q5_0
    assert p["blk.0.attn_v.weight"] == Q8_0  # Q6_K -> Q8_0
    assert p["blk.4.ffn_down.weight"] == Q4_K  # 1536 = 6 * 256 (layer 4 gets no extra bits)
    assert presets.fallback(Q4_K, 40) == presets.F16  # not even 32 divides it
    assert plan("Q2_K", _shapes(d=576, ff=1536), 8, 3)["blk.3.attn_q.weight"] == Q4_0


def test_registry_lookup_and_errors():
    fmt, param = registry.lookup("q4_k_m")
    assert fmt.name == "Q4_K_M" and fmt.container == "gguf" and param is None
    fmt, param = registry.lookup("mixed:4.5")
    assert fmt.name == "mixed" and param == "4.5"
    assert registry.lookup("safetensors")[0].container == "safetensors"
    with pytest.raises(registry.UnknownFormatError, match="known formats"):
        registry.lookup("Q7_X")
    with pytest.raises(registry.UnknownFormatError, match="needs a parameter"):
        registry.lookup("mixed")
    with pytest.raises(registry.UnknownFormatError, match="takes no"):
        registry.lookup("Q8_0:3")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.TargetFormat("Q8_0", "gguf", lambda *a: None))


def test_mixed_assignment_is_optimal_on_small_instance():
    rng = np.random.default_rng(0)
    types = (presets.Q2_K, presets.Q3_K, Q4_K, Q5_K, Q6_K, Q8_0)
    errors = {}
    for k in range(5):
        n = int(rng.integers(1, 5)) * 1000
        base = float(rng.uniform(0.5, 5))
        # error roughly halves per extra bit, as quantization error does
        errors[f"t{k}"] = {t: (base * n * 2.0 ** (-bits_per_weight(t)), n) for t in types}
    budget = 4.5
    got = assign(errors, budget)
    total = sum(v[Q8_0][1] for v in errors.values())
    assert got.bpw <= budget + 1e-9
    best = None
    for combo in itertools.product(types, repeat=len(errors)):
        bits = sum(bits_per_weight(t) * errors[n][t][1] for n, t in zip(errors, combo))
        if bits <= budget * total:
            err = sum(errors[n][t][0] for n, t in zip(errors, combo))
            best = err if best is None else min(best, err)
    ours = sum(got.errors.values())
    assert ours <= best * 1.05  # Lagrangian on the hulls: optimal up to the last partial upgrade


def test_budget_errors():
    with pytest.raises(BudgetError):
        parse_budget("abc")
    with pytest.raises(BudgetError):
        parse_budget("1.0")
    errors = {"a": {Q4_K: (1.0, 10), Q8_0: (0.1, 10)}}
    with pytest.raises(BudgetError, match="below"):
        assign(errors, 3.0)
