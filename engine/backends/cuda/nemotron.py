"""Nemotron-H (engine/arch/nemotron_h.py) in the terms the CUDA decoder reads a llama model in.

A Nemotron-H block is an RMSNorm, one mixer and a residual add; a llama layer has two such branches, a
mixer (attention, or Mamba-2 as in Granite 4.0-H) and an FFN. Here each block becomes a layer with one of
the two: a Mamba-2 or attention block its mixer branch and no FFN, an MLP block (down(relu(up x)^2), not
gated) its FFN branch and no mixer. Block i stays layer i, so `--gpu-layers N` counts blocks as
llama.cpp does, and the cache numbers the attention and Mamba-2 blocks as the CPU model's does. The
weights are the CPU model's (still mapped, nothing copied); attention has no positions (every layer a
NoPE one) and scales its scores by head_dim ** -0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.arch.llama import LlamaConfig, LlamaLayer
from engine.arch.nemotron_h import ATTENTION, MAMBA, MLP, NemotronHModel

LAYER_TYPES = {MAMBA: "linear_attention", ATTENTION: "full_attention", MLP: "mlp"}


@dataclass
class Block(LlamaLayer):
    """A Nemotron-H block as a layer of one branch: mixer False where it has no mixer (an MLP block), ffn
    None where it has no FFN (a mixer block); "relu2" is the MLP's non-gated activation ("glu": a llama
    layer's gated FFN, the CUDA decoder's default)."""

    mixer: bool = True
    ffn: str | None = "glu"


@dataclass
class BlockConfig(LlamaConfig):
    """LlamaConfig whose "mlp" layers keep nothing in the cache (neither keys and values nor a state), so
    cache_slot numbers the attention and Mamba-2 blocks among their own kind only."""

    def _kind(self, layer: int) -> str:
        if self.layer_types is not None and self.layer_types[layer] == "mlp":
            return "mlp"
        return super()._kind(layer)


class NemotronHBlocks:
    """A NemotronHModel as the CUDA decoder reads a LlamaModel: cfg (BlockConfig), layers (Blocks), the
    embedding, final norm and output matrix, the attention scale, and RoPE's frequencies (unused: no layer
    rotates)."""

    rope_mscale = 1.0

    def __init__(self, model: NemotronHModel):
        c = model.cfg
        n = c.num_hidden_layers
        self.cfg = BlockConfig(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=n,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
            vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, head_dim=c.head_dim,
            max_position_embeddings=c.max_position_embeddings, architecture=c.architecture, mamba=c.mamba,
            layer_types=tuple(LAYER_TYPES[k] for k in c.kinds), rope_layers=(False,) * n,
        )
        self.token_embd, self.output, self.output_norm = model.token_embd, model.output, model.output_norm
        self.scale = model.scale
        self.layers = [self._block(layer) for layer in model.layers]

    @staticmethod
    def _block(layer) -> Block:
        w = dict(wq=None, wk=None, wv=None, wo=None, w_gate=None, w_up=None, w_down=None)
        if layer.kind == MLP:
            w.update(w_up=layer.w_up, w_down=layer.w_down)
            return Block(attn_norm=None, ffn_norm=layer.norm, **w, mixer=False, ffn="relu2")
        if layer.kind == ATTENTION:
            w.update(wq=layer.wq, wk=layer.wk, wv=layer.wv, wo=layer.wo)
        return Block(attn_norm=layer.norm, ffn_norm=None, **w, mamba=layer.mamba, ffn=None)

    def _scale_of(self, i: int) -> np.float32:
        return self.scale

    def _plain(self, i: int) -> bool:
        return False

    def rope_freqs(self, n_ctx: int) -> np.ndarray:
        return np.zeros(max(1, self.cfg.head_dim // 2), np.float32)
