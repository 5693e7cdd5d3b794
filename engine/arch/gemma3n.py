"""Gemma 3n text decoder (gemma-3n-E2B / E4B), following Hugging Face's modeling_gemma3n.

Gemma 3n is Gemma 4's E models' forerunner, and runs on engine/arch/gemma4.py's machinery: one head shape on
every layer, q/k norms and weightless value norms, attention scale 1, the last num_kv_shared_layers layers
reading the keys and values of the last earlier layer of their kind, per-layer embeddings, logit capping.
What it adds:
- AltUp: the residual stream is altup_num_inputs streams. The embedding is the first; the others are
  projections of it rescaled to its RMS. Each layer predicts every stream from all of them with
  coefficients a router (tanh of a linear over the normed active stream, times 1 / hidden) chooses, runs
  on the active stream's prediction only, then corrects every prediction by the layer's innovation (its
  output minus the active prediction) times router-chosen coefficients plus one. The per-layer-input
  branch reads the corrected active stream times a learnt scale and adds to the other streams. At the end,
  the other streams are projected back, rescaled to the first's RMS, and all averaged. (transformers clips
  the coefficient matrices to +-altup_coef_clip only while training; inference uses them as stored.)
- LAuReL: beside attention, x + norm(right(left(x))) of the layer's normed input (a low-rank residual);
  the attention output, the active prediction and it are summed and divided by sqrt(2);
- activation sparsity: on the layers whose activation_sparsity_pattern share p > 0, each gate row keeps
  what lies above mean + icdf(p) * std (gemma4.gaussian_top_k) before the GELU;
- no layer scalar; RMSNorms multiply by w (as Gemma 4's); per-layer embeddings past their table (the
  vocabulary's audio and image ids) read row 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from engine.arch import register
from engine.arch.base import gguf_key
from engine.arch.gemma3 import FULL, SLIDING
from engine.arch.gemma4 import Gemma4Config, Gemma4Model, _Scratch
from engine.backends import cpu as ops
from engine.weights import Weight


@dataclass
class Gemma3nConfig(Gemma4Config):
    """Hyper-parameters, named as in Hugging Face's Gemma3nTextConfig (intermediate_sizes: its
    intermediate_size list). Gemma 4's global-layer fields follow the windowed layers' (one head shape,
    full RoPE everywhere)."""

    altup_num_inputs: int = 4
    altup_active_idx: int = 0
    altup_correct_scale: bool = True
    laurel_rank: int = 64
    activation_sparsity_pattern: list[float] | None = None  # None: 0.95 on the first 10 layers (of > 10)
    architecture: str = "gemma3n"

    def __post_init__(self):
        self.global_head_dim = self.head_dim
        self.num_global_key_value_heads = self.num_key_value_heads
        self.global_rotary_factor = 1.0
        self.global_rope_factor = 1.0
        self.local_rotary_dim = self.head_dim
        self.num_experts = 0
        super().__post_init__()
        n = self.num_hidden_layers
        if self.activation_sparsity_pattern is None:
            sparse = 10 if n > 10 else 0
            self.activation_sparsity_pattern = [0.95] * sparse + [0.0] * (n - sparse)
        pattern = [float(p) for p in self.activation_sparsity_pattern]
        if len(pattern) != n or not all(0.0 <= p < 1.0 for p in pattern):
            raise ValueError(f"activation_sparsity_pattern needs a share in [0, 1) for each of {n} layers")
        self.activation_sparsity_pattern = pattern
        if not 0 <= self.altup_active_idx < self.altup_num_inputs:
            raise ValueError(f"altup_active_idx {self.altup_active_idx} of {self.altup_num_inputs} inputs")
        if self.laurel_rank < 0 or not self.hidden_size_per_layer_input:
            raise ValueError("Gemma 3n needs laurel_rank and hidden_size_per_layer_input")

    @property
    def sparsity_stds(self) -> list[float]:
        """Each layer's gate cut-off in standard deviations above the mean: the standard normal quantile of
        its sparsity share (-inf on dense layers: nothing cut), as llama.cpp's activation_sparsity_scale."""
        return [float(np.float32(NormalDist().inv_cdf(p))) if p > 0 else -math.inf
                for p in self.activation_sparsity_pattern]

    @classmethod
    def from_gguf(cls, metadata: dict, vocab_size: int) -> Gemma3nConfig:
        """Config from llama.cpp's `gemma3n.*` keys (its Gemma3NModel converter); the sparsity comes as normal
        quantiles. The per-layer table's rows and LAuReL's rank are the tensors' (Gemma3nModel reads them).

        Raises:
            KeyError: a required key is missing. ValueError: values are inconsistent.
        """
        key = gguf_key(metadata)
        n_layers = int(key("block_count"))
        flags = key("attention.sliding_window_pattern")
        if np.ndim(flags) == 0 or len(flags) != n_layers:
            raise ValueError("attention.sliding_window_pattern must hold one flag per layer")
        head_dim = int(key("attention.key_length"))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise ValueError("key and value head sizes differ")
        ff = key("feed_forward_length")
        ff = [int(v) for v in ff] if np.ndim(ff) else [int(ff)] * n_layers
        stds = [float(v) for v in key("activation_sparsity_scale")]
        softcapping = float(key("final_logit_softcapping", 0.0))
        return cls(
            hidden_size=int(key("embedding_length")),
            intermediate_size=ff[0],
            intermediate_sizes=ff,
            num_hidden_layers=n_layers,
            num_attention_heads=int(key("attention.head_count")),
            num_key_value_heads=int(key("attention.head_count_kv")),
            vocab_size=vocab_size,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 1_000_000.0)),
            rope_local_base_freq=float(key("rope.freq_base_swa", 10_000.0)),
            sliding_window=int(key("attention.sliding_window")),
            layer_types=[SLIDING if bool(f) else FULL for f in flags],
            max_position_embeddings=int(key("context_length", 32_768)),
            final_logit_softcapping=softcapping if softcapping > 0 else None,
            num_kv_shared_layers=int(key("attention.shared_kv_layers", 0)),
            hidden_size_per_layer_input=int(key("embedding_length_per_layer_input")),
            vocab_size_per_layer_input=vocab_size,
            altup_num_inputs=int(key("altup.num_inputs", 4)),
            altup_active_idx=int(key("altup.active_idx", 0)),
            laurel_rank=0,  # from the laurel_l tensor (Gemma3nModel)
            activation_sparsity_pattern=[NormalDist().cdf(v) if math.isfinite(v) else 0.0 for v in stds],
            architecture=metadata["general.architecture"],
        )


@dataclass
class AltUpLaurel:
    """One layer's AltUp router and coefficients and its LAuReL block."""

    router_norm: np.ndarray  # (hidden,), with the router's 1 / hidden folded in
    router: np.ndarray  # (hidden, A): the router's linear, transposed
    predict: np.ndarray  # (A, A * A): prediction coefficients (of stream k from stream j: column k * A + j)
    correct: np.ndarray  # (A, A): correction coefficients
    output_scale: np.ndarray | None  # (hidden,): the corrected active stream's scale; None: 1
    laurel_left: Weight  # (rank, hidden)
    laurel_right: Weight  # (hidden, rank)
    laurel_norm: np.ndarray  # (hidden,)


class _Scratch3n(_Scratch):
    """Gemma 4's buffers plus the AltUp streams and their predictions (A, n, hidden), LAuReL's."""

    def __init__(self, cfg: Gemma3nConfig, n: int):
        super().__init__(cfg, n)
        a, d = cfg.altup_num_inputs, cfg.hidden_size
        self.streams = np.empty((a, n, d), np.float32)
        self.pred = np.empty((a, n, d), np.float32)
        self.active = np.empty((n, d), np.float32)
        self.laurel = np.empty((n, cfg.laurel_rank), np.float32)


@register("gemma3n")
class Gemma3nModel(Gemma4Model):
    """A Gemma 3n decoder over weights that stay in their file format (see the module docstring)."""

    config_class = Gemma3nConfig

    def __init__(self, cfg: Gemma3nConfig, weights):
        """Args: cfg; weights: a weight source with matrix, vector, floats, experts and has by GGUF name."""
        self.blocks = []
        if not cfg.laurel_rank:  # a GGUF's config: what its metadata does not give, from its tensors' shapes
            cfg.laurel_rank = weights.shape("blk.0.laurel_l.weight")[0]
            # llama.cpp's newer converter pads the table to the vocabulary (zero rows), its older one did not
            cfg.vocab_size_per_layer_input = weights.shape("per_layer_token_embd.weight")[0]
        super().__init__(cfg, weights)
        d, a = cfg.hidden_size, cfg.altup_num_inputs
        # the extra streams' projections in and out: llama.cpp stacks them (A - 1, hidden, hidden)
        self.altup_proj = weights.experts("altup_proj.weight", a - 1, d, d)
        self.altup_unembd = weights.experts("altup_unembd_proj.weight", a - 1, d, d)

    def _layer(self, weights, i: int, local_freq: np.ndarray, global_freq: np.ndarray):
        cfg = self.cfg
        layer = super()._layer(weights, i, local_freq, global_freq)
        if cfg.activation_sparsity_pattern[i] > 0:
            layer.sparsity_std = np.float32(cfg.sparsity_stds[i])
        p, d, a = f"blk.{i}.", cfg.hidden_size, cfg.altup_num_inputs
        self.blocks.append(
            AltUpLaurel(
                router_norm=weights.vector(p + "altup_router_norm.weight", d) * np.float32(1.0 / d),
                router=np.ascontiguousarray(weights.floats(p + "altup_router.weight", (a, d)).T),
                predict=np.ascontiguousarray(weights.floats(p + "altup_predict_coef.weight", (a * a, a)).T),
                correct=np.ascontiguousarray(weights.floats(p + "altup_correct_coef.weight", (a, a)).T),
                output_scale=weights.vector(p + "altup_correct_scale.weight", d) if cfg.altup_correct_scale
                else None,
                laurel_left=weights.matrix(p + "laurel_l.weight", cfg.laurel_rank, d),
                laurel_right=weights.matrix(p + "laurel_r.weight", d, cfg.laurel_rank),
                laurel_norm=weights.vector(p + "laurel_post_norm.weight", d),
            )
        )
        return layer

    def _new_scratch(self, n: int) -> _Scratch3n:
        return _Scratch3n(self.cfg, n)

    def _last_row(self, s: _Scratch3n) -> _Scratch3n:
        last = super()._last_row(s)
        last.streams[:, 0] = s.streams[:, -1]
        return last

    def _layers(self, s: _Scratch3n, ids: np.ndarray, attend, last_only: bool) -> _Scratch3n:
        """Embed ids into the AltUp streams, run every layer (attend: as Gemma4Model._layers) and leave the
        streams' average in s.x. With last_only, the shared-KV layers run on the last row alone, in the
        one-row scratch, which is returned (else s)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        act = cfg.altup_active_idx
        ops.get_rows(s.x, self.token_embd, ids)
        s.x *= self.embed_scale
        self._per_layer_inputs(s, np.where(ids < cfg.vocab_size_per_layer_input, ids, 0))
        s.streams[0] = s.x
        self._project_streams(s.streams, s.x, self.altup_proj, s.h)
        for i, (layer, block) in enumerate(zip(self.layers, self.blocks)):
            if i == cfg.first_shared_layer and last_only and s.n > 1:
                s = self._last_row(s)
            self._predict(s, block)
            s.active[:] = s.pred[act]
            ops.rmsnorm(s.h, s.active, layer.attn_norm, eps)
            # LAuReL beside attention, in s.y: the normed input plus a norm of its low-rank map
            ops.linear(s.laurel, block.laurel_left, s.h)
            ops.linear(s.y, block.laurel_right, s.laurel)
            ops.rmsnorm(s.y, s.y, block.laurel_norm, eps)
            s.y += s.h
            self._attention(s, layer, i, attend)
            ops.rmsnorm(s.h, s.o, layer.post_attn_norm, eps)
            np.add(s.active, s.h, out=s.x)
            s.x += s.y
            s.x /= np.float32(math.sqrt(2))
            self._ffn(s, layer)
            self._correct(s, block)
            s.x[:] = s.streams[act]
            if block.output_scale is not None:
                s.x *= block.output_scale
            self._per_layer_branch(s, layer, i, s.x)
            s.streams[1:] += s.h
        # the streams back into one: the others unprojected to the first's RMS, all averaged
        self._project_streams(s.streams, s.streams[0], self.altup_unembd, s.h, unembed=True)
        s.streams.mean(axis=0, out=s.x, dtype=np.float32)
        return s

    @staticmethod
    def _project_streams(streams: np.ndarray, first: np.ndarray, projections: list[Weight], buf: np.ndarray,
                         unembed: bool = False) -> None:
        """streams[k] = proj_k(first) (in) or proj_k(streams[k]) (unembed), k >= 1, at first's RMS."""
        target = np.sqrt(np.mean(np.square(first), axis=-1, keepdims=True, dtype=np.float32))
        for k, w in enumerate(projections, 1):
            ops.linear(buf, w, streams[k] if unembed else first)
            rms = np.sqrt(np.maximum(np.mean(np.square(buf), axis=-1, keepdims=True, dtype=np.float32),
                                     np.float32(1e-5)))
            np.multiply(buf, target, out=streams[k])
            streams[k] /= rms

    def _router(self, x: np.ndarray, block: AltUpLaurel, out: np.ndarray) -> np.ndarray:
        """tanh(router(norm(x) / hidden)) (n, A); out (n, hidden) is scratch."""
        ops.rmsnorm(out, x, block.router_norm, self.cfg.rms_norm_eps)
        return np.tanh(out @ block.router)

    def _predict(self, s: _Scratch3n, block: AltUpLaurel) -> None:
        """s.pred[k] = s.streams[k] + sum_j c[k, j] s.streams[j], c per row from the router."""
        a = self.cfg.altup_num_inputs
        modalities = self._router(s.streams[self.cfg.altup_active_idx], block, s.h)
        coefs = (modalities @ block.predict).reshape(-1, a, a)
        s.pred[:] = s.streams
        for k in range(a):
            for j in range(a):
                s.pred[k] += coefs[:, k, j, None] * s.streams[j]

    def _correct(self, s: _Scratch3n, block: AltUpLaurel) -> None:
        """s.streams[k] = s.pred[k] + (c_k + 1) (s.x - s.pred[active]), c per row from the router on s.x."""
        coefs = self._router(s.x, block, s.h) @ block.correct + np.float32(1.0)
        np.subtract(s.x, s.pred[self.cfg.altup_active_idx], out=s.active)
        for k in range(self.cfg.altup_num_inputs):
            np.multiply(s.active, coefs[:, k, None], out=s.streams[k])
            s.streams[k] += s.pred[k]
