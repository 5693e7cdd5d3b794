"""Quantization: ggml block encoders, target formats of `hearth convert`, mixed bit-width assignment.

Public API:
    quantize(ggml_type, matrix) -> uint8 (rows, row_nbytes)   engine.quant.encode
    dequantize(ggml_type, raw, cols) -> float32 (rows, cols)  engine.quant.encode
    registry.register / registry.lookup                        engine.quant.registry
"""

from __future__ import annotations


def quantize(ggml_type, matrix):
    """Encode a float32 (rows, cols) matrix as ggml `ggml_type` rows; see engine.quant.encode.quantize."""
    from engine.quant.encode import quantize as _quantize

    return _quantize(ggml_type, matrix)


def dequantize(ggml_type, raw, cols):
    """Decode ggml rows back to float32 (rows, cols); see engine.quant.encode.dequantize."""
    from engine.quant.encode import dequantize as _dequantize

    return _dequantize(ggml_type, raw, cols)
