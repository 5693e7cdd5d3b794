"""Model families beyond plain llama and Gemma 3 on the CUDA backend, without a GPU: the tiny checkpoints of
tests/fixtures/tiny (whose golden logits come from transformers) through the whole CUDA decoder, its kernels
on host threads (tests/engine/cuda/simt.py, over test_decoder_dry's stand-in CuPy), against the CPU model:
gpt-oss (attention sinks, a sliding window on every other layer, biases on every linear, YaRN, MXFP4
experts with biases and the clamped SwiGLU), Gemma 2 (soft-capped attention and logits) and Mistral's
sliding window on every layer.
"""
# ruff: noqa: F811 - the stand-in CuPy fixtures are imported from test_decoder_dry

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.cuda.test_decoder_dry import (  # noqa: F401 - fixtures
    FULL_SIMT,
    STATE,
    check_decoder_against_cpu,
    fake,
    ptx_params,
    simt,
)

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"
PROMPT = [1, 2, 3, 40, 41, 42, 7]  # longer than the tiny models' windows of 4


def test_gpt_oss_on_the_gpu_computes_the_cpu_models_logits_on_host_threads(fake, simt):
    """The tiny gpt-oss folder: sinks and the window in prefill and decode attention, the output
    projection's bias, the router's bias, each expert's gate|up and down biases around the clamped SwiGLU
    (decode: one activation launch for the B x k slots; prefill: each expert's rows), MXFP4 experts on
    integer dot products; prefill, graph steps, the GPU argmax, a batch and partial offload."""
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(TINY / "gpt-oss").model
    assert model.cfg.window(0) == 4 and model.layers[0].sinks is not None and model.layers[0].bo is not None
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    assert [L["window"] for L in dec.layers] == [4, 0]
    assert dec.layers[0]["moe"]["gu_bias"].shape == (4, 2 * model.cfg.intermediate_size)
    steps = check_decoder_against_cpu(fake, model, dec, PROMPT)
    assert {"glu", "moe_route", "matvec_qb_experts", "moe_combine", "add_inplace"} <= set(steps)
    assert fake.fused.unsupported_reason(dec) == "mixture-of-experts layers"


@pytest.mark.parametrize(
    "family", ["gemma2"] + [
        pytest.param(f, marks=pytest.mark.skipif(not FULL_SIMT, reason="set HEARTH_CUDA_SIMT=1"))
        for f in ("mistral-swa",)
    ],
)
def test_attention_variants_compute_the_cpu_models_logits_on_host_threads(fake, simt, family):
    """Gemma 2's soft-capped attention scores (and final logits) and Mistral v0.1's window on every layer
    through the whole decoder against the CPU model."""
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(TINY / family).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    if family == "gemma2":
        assert dec.softcap == model.cfg.attn_logit_softcapping > 0
        assert fake.fused.unsupported_reason(dec) == "attention soft-capping (Gemma 2)"
    else:
        assert all(L["window"] == model.cfg.sliding_window > 0 for L in dec.layers)
    check_decoder_against_cpu(fake, model, dec, PROMPT)
