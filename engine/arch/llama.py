"""Llama family: Llama 2/3, Mistral, SmolLM2/3, Qwen2/3, Phi-3 (GQA, RoPE, RMSNorm, SwiGLU), the variants
that change a piece of that layer, and the mixture-of-experts members (engine/arch/moe.py in place of the
dense FFN).

Variants: SmolLM3 leaves RoPE out of every fourth layer; Granite 3 scales the embeddings, residual
branches, attention scores and logits by constants; GLM-4 norms each branch's output too and rotates half
of each head in adjacent pairs, as ERNIE 4.5 does on whole heads; OLMo 2 norms only the branch outputs, and
q and k over their whole width; OLMo 3 adds a window on three layers of four, which rotate with plain RoPE;
EXAONE 4 norms only the branch outputs too, and with a window rotates only in the windowed layers; Seed-OSS
is a llama with QKV biases; Ministral 3 scales its queries up past the original context (Llama 4's
temperature tuning); LFM2 replaces attention with a gated short convolution (engine/arch/shortconv.py)
in most layers and norms q and k per head; Qwen3.5 replaces it with a gated DeltaNet (engine/arch/deltanet.py)
in three layers of four and gates the output of the others, as Qwen3-Next does (its DeltaNet's projections
fused per key head, dense FFNs in some layers of its mixture of experts). Qwen3-VL (llama.cpp's qwen3vl and
qwen3vlmoe) is Qwen3 or Qwen3-MoE whose image rows take M-RoPE positions and, after the first layers, its
vision tower's deepstack sets (engine/vision/qwen35.py); Qwen2-VL's and Qwen2.5-VL's language model
(llama.cpp's qwen2vl) is Qwen2 whose rotary pairs turn by M-RoPE positions once a vision tower sets `mrope`.
Cohere's Command R (llama.cpp's command-r) and Command R7B / Command A (cohere2) run attention and FFN side
by side from one LayerNorm (mean subtracted, no bias), both added to the residual stream, rotate adjacent
pairs and multiply their logits by logit_scale (Command R+ LayerNorms q and k per head, with weights per
head); cohere2 adds a window on three layers of four, which alone rotate (EXAONE 4's switches).
Mixture of experts: Mixtral, Qwen3-MoE, Qwen2-MoE (with a gated shared expert) and gpt-oss (attention
sinks, biases on every linear, a sliding window on every other layer and a clamped SwiGLU in its experts);
ERNIE 4.5 MoE is ERNIE 4.5 with experts chosen by biased softmax probabilities beside ungated shared
experts, in every moe_layer_interval-th layer past the dense leading ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from engine.arch import deltanet, mamba2, register
from engine.arch.base import Decoder, Scratch, gguf_key
from engine.arch.deltanet import DeltaNet, DeltaShape, load_deltanet
from engine.arch.mamba2 import Mamba2, MambaShape, load_mamba2
from engine.arch.moe import MoE, load_moe, moe_forward
from engine.arch.shortconv import ShortConv, convolve, gated_inputs, load_shortconv
from engine.backends import cpu as ops
from engine.kv_cache import KVCache, RecurrentKVCache, ShortConvKVCache
from engine.rope import RopeScaling, rope_attention_factor, rope_inv_freq, rope_scaling_from_gguf
from engine.weights import Weight

# llama.cpp's converter permutes Llama's q/k weights so GGML's "normal" RoPE (adjacent pairs) applies;
# these families keep HF's half-split ("NeoX") layout instead.
_NEOX_ROPE = frozenset(
    {"qwen2", "qwen2moe", "qwen3", "qwen3moe", "phi3", "gpt-oss", "olmo2", "glm4moe", "exaone4", "seed_oss",
     "lfm2", "lfm2moe", "qwen35", "qwen35moe", "qwen3next", "qwen3vl", "qwen3vlmoe",
     "qwen2vl"}
)
# GGUF architectures that may carry attention.sliding_window (Mistral v0.1 as "llama", gpt-oss, OLMo 3;
# EXAONE 4's, with its default, is read on its own)
_WINDOWED = frozenset({"llama", "gpt-oss", "olmo2", "cohere2"})
# Cohere's GGUF architectures: parallel blocks under a LayerNorm (LlamaConfig.parallel_block)
COHERE_ARCHS = frozenset({"command-r", "cohere2"})
# every FFN is experts: no dense feed_forward_length needed in the GGUF
# architectures whose GGUFs give KV heads per layer, 0 in the layers without attention (LFM2's convolution
# layers, Granite 4.0-H's Mamba-2 ones)
_KV_PER_LAYER = frozenset({"lfm2", "lfm2moe", "granitehybrid"})
_MOE_ONLY = frozenset({"qwen2moe", "qwen3moe", "gpt-oss", "qwen35moe", "qwen3next", "qwen3vlmoe"})


@dataclass
class LlamaConfig:
    """Hyper-parameters, named as in Hugging Face config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5  # every norm's epsilon (Cohere's LayerNorms': its layer_norm_eps)
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rotary_dim: int = 0  # 0: head_dim
    rope_neox: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    architecture: str = "llama"
    # mixture of experts (Mixtral, Qwen3-MoE): experts per layer (0: a dense FFN), experts per token,
    # whether the chosen experts' weights are renormalized; intermediate_size is then an expert's
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    # the intermediate size of a shared expert every token runs beside the routed ones (Qwen2-MoE, GLM-4.5;
    # 0: none)
    shared_expert_intermediate_size: int = 0
    # routing: "softmax" over the logits, or "sigmoid" scores with a per-expert choice bias (GLM-4.5); the
    # chosen experts' weights are multiplied by expert_weights_scale
    expert_gating: str = "softmax"
    expert_weights_scale: float = 1.0
    # group-limited routing (DeepSeek's n_group / topk_group): the experts in expert_groups equal groups, a
    # token choosing among its expert_groups_used best groups only (moe.route; 0: no limit)
    expert_groups: int = 1
    expert_groups_used: int = 0
    # the first layers keep a dense FFN of dense_intermediate_size (GLM-4.5's first_k_dense_replace, ERNIE 4.5
    # MoE's moe_layer_start_index), and so do the layers in dense_layers (Qwen3-Next's mlp_only_layers and
    # those its decoder_sparse_step skips; those ERNIE 4.5 MoE's moe_layer_interval and end index leave out)
    first_dense_layers: int = 0
    dense_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    # the experts' activation: "silu" (silu(gate) * up) or "swiglu_oai" (gpt-oss: gate clamped above and up
    # both ways at swiglu_limit, then gate * sigmoid(swiglu_alpha gate) * (up + 1))
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # sliding-window attention: keys [p - sliding_window + 1, p] for a query at p (0: none), on the layers
    # layer_types names "sliding_attention" (None: every layer; Mistral v0.1)
    sliding_window: int = 0
    layer_types: tuple[str, ...] | None = None
    # the windowed layers rotate with plain RoPE (same theta, no scaling or attention factor) while the full
    # layers take rope_scaling (OLMo 3)
    window_rope_unscaled: bool = False
    # which layers rotate q and k (SmolLM3: all but every fourth, "NoPE" layers); None: every layer
    rope_layers: tuple[bool, ...] | None = None
    # Ministral 3 (Llama 4's attention temperature): queries at position p are multiplied by
    # 1 + attn_temperature_beta * log(1 + floor(p / attn_temperature_length)) after RoPE (0: off)
    attn_temperature_beta: float = 0.0
    attn_temperature_length: int = 0
    # LFM2: the layers layer_types names "conv" run a gated short convolution of conv_taps taps in place of
    # attention
    conv_taps: int = 0
    # Qwen3.5: the layers layer_types names "linear_attention" run a gated DeltaNet of these sizes
    # (engine/arch/deltanet.py); its attention layers gate their output by sigmoid(a second half of q_proj)
    delta: DeltaShape | None = None
    attn_output_gate: bool = False
    # Granite 4.0-H: those layers run Mamba-2 of these sizes instead (engine/arch/mamba2.py)
    mamba: MambaShape | None = None
    # Granite's constants: the embeddings and every residual branch are scaled, the attention scores use
    # attention_multiplier instead of 1/sqrt(head_dim) (0: that default), the logits are divided
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 0.0
    logits_scaling: float = 1.0
    # Cohere's logits are multiplied by logit_scale
    logit_scale: float = 1.0
    # Qwen3-VL (llama.cpp's qwen3vl / qwen3vlmoe: Qwen3 / Qwen3-MoE with M-RoPE): how many deepstack sets its
    # vision tower adds to the image rows after the first layers (llama.cpp's n_deepstack_layers), which a
    # tower beside it must give; 0 for other models
    deepstack_layers: int = 0
    # derived in __post_init__
    n_rep: int = field(init=False)
    q_dim: int = field(init=False)
    kv_dim: int = field(init=False)
    _slots: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rotary_dim == 0:
            self.rotary_dim = self.head_dim
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.n_rep = self.num_attention_heads // self.num_key_value_heads
        self.q_dim = self.num_attention_heads * self.head_dim
        self.kv_dim = self.num_key_value_heads * self.head_dim
        if self.expert_act not in ("silu", "swiglu_oai"):
            raise ValueError(f"unknown expert activation {self.expert_act!r}")
        if self.expert_gating not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown expert gating {self.expert_gating!r}")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_hidden_layers} layers")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_hidden_layers:
            raise ValueError(f"{len(self.rope_layers)} RoPE flags for {self.num_hidden_layers} layers")
        if self.attn_temperature_beta and self.attn_temperature_length < 1:
            raise ValueError("attention temperature scaling needs attn_temperature_length >= 1")
        kinds = [self._kind(i) for i in range(self.num_hidden_layers)]
        if "conv" in kinds and self.conv_taps < 1:
            raise ValueError("convolution layers need conv_taps >= 1")
        if "recurrent" in kinds and (self.delta is None) == (self.mamba is None):
            raise ValueError("linear-attention layers need the sizes of a DeltaNet or of Mamba-2")
        self._slots = tuple(kinds[:i].count(k) for i, k in enumerate(kinds))

    def is_conv(self, layer: int) -> bool:
        """Layer `layer` runs LFM2's short convolution instead of attention."""
        return self.layer_types is not None and self.layer_types[layer] == "conv"

    def is_recurrent(self, layer: int) -> bool:
        """Layer `layer` runs Qwen3.5's gated DeltaNet or Mamba-2 (Granite 4.0-H) instead of attention."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    def _kind(self, layer: int) -> str:
        return "conv" if self.is_conv(layer) else "recurrent" if self.is_recurrent(layer) else "attention"

    def keeps_kv(self, layer: int) -> bool:
        """Layer `layer` keeps keys and values in the cache (an attention layer)."""
        return self._kind(layer) == "attention"

    @property
    def n_conv_layers(self) -> int:
        return sum(map(self.is_conv, range(self.num_hidden_layers)))

    @property
    def n_recurrent_layers(self) -> int:
        return sum(map(self.is_recurrent, range(self.num_hidden_layers)))

    @property
    def recurrent_shapes(self) -> tuple[tuple[int, ...], tuple[int, int]]:
        """A recurrent layer's state shape (DeltaNet: per value head (head_k, head_v); Mamba-2: per head
        (head_dim, state_size)) and its convolution's kept inputs (taps - 1, conv_dim), as
        RecurrentKVCache holds them."""
        shape = self.delta or self.mamba
        state = (shape.v_heads, shape.head_k, shape.head_v) if self.delta else shape.state_dims
        return state, (shape.taps - 1, shape.conv_dim)

    def cache_slot(self, layer: int, first: int = 0) -> int:
        """Layer `layer`'s index in a cache of the layers from `first` on: its place among them in the
        layers of its kind (attention, convolution or recurrent), as the cache numbers them."""
        kind = self._kind(layer)
        return self._slots[layer] - sum(self._kind(i) == kind for i in range(first))

    def window(self, layer: int) -> int | None:
        """Layer's attention window (ops.attention's `window`), None for full attention."""
        if not self.sliding_window:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def scaled(self) -> bool:
        """Granite's constants differ from a plain llama's."""
        return (self.embedding_multiplier, self.residual_multiplier, self.attention_multiplier,
                self.logits_scaling) != (1.0, 1.0, 0.0, 1.0)

    @property
    def post_norm_only(self) -> bool:
        """OLMo 2, EXAONE 4: no norms before the attention and FFN, RMSNorm of their outputs instead."""
        return self.architecture in ("olmo2", "exaone4")

    @property
    def parallel_block(self) -> bool:
        """Cohere (Command R, R7B, A): one LayerNorm (mean subtracted, weight only; the final norm too) feeds
        attention and the FFN side by side, both added to the residual stream."""
        return self.architecture in COHERE_ARCHS

    @property
    def qk_norm_full(self) -> bool:
        """OLMo 2: q/k norms over the whole projections (not per head)."""
        return self.architecture == "olmo2"

    def has_experts(self, layer: int) -> bool:
        """Layer `layer` runs a mixture of experts (not one of the leading or other dense layers)."""
        return bool(self.num_experts) and layer >= self.first_dense_layers and layer not in self.dense_layers

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k (False in SmolLM3's NoPE layers)."""
        return self.rope_layers is None or self.rope_layers[layer]

    @classmethod
    def from_gguf(cls, metadata: dict, vocab_size: int) -> LlamaConfig:
        arch = metadata["general.architecture"]
        key = gguf_key(metadata)

        n_heads = int(key("attention.head_count"))
        # LFM2 gives KV heads per layer, 0 in its convolution layers
        kv_heads = key("attention.head_count_kv", n_heads)
        conv_types = None
        if hasattr(kv_heads, "__len__"):
            per_layer = [int(h) for h in kv_heads]
            conv_types = tuple("conv" if h == 0 else "full_attention" for h in per_layer)
            kv_heads = max(per_layer)
            if any(h not in (0, kv_heads) for h in per_layer) or arch not in _KV_PER_LAYER:
                raise ValueError(f"{arch}: KV head counts per layer {per_layer} are not supported")
            if arch == "granitehybrid":  # its layers without keys and values run Mamba-2
                conv_types = tuple("linear_attention" if h == 0 else "full_attention" for h in per_layer)
        hidden = int(key("embedding_length"))
        head_dim = int(key("attention.key_length", hidden // n_heads))
        scaling = rope_scaling_from_gguf(metadata, arch)
        if scaling.kind == "linear" and scaling.factor == 1.0:
            scaling = RopeScaling()
        log_mul = metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier")
        if arch == "mistral3" and scaling.kind == "yarn" and log_mul:
            # llama.cpp's Ministral 3: mscale 1 over mscale_all_dim (the key's value), as transformers' YaRN
            scaling = dataclasses.replace(
                scaling, mscale=1.0, mscale_all_dim=float(log_mul), attention_factor=None
            )
        gpt_oss = arch == "gpt-oss"
        if gpt_oss and scaling.kind == "yarn":
            # gpt-oss was trained with YaRN's ramp ends unrounded (its config's "truncate": false)
            scaling = dataclasses.replace(scaling, truncate=False)
        # GLM-4.5's GGUFs count their next-token-prediction layers in block_count; they are not run
        n_layers = int(key("block_count")) - int(metadata.get(f"{arch}.nextn_predict_layers", 0))
        olmo = arch == "olmo2" and bool(metadata.get("olmo2.attention.sliding_window"))
        # EXAONE 4: a window on three layers of four when the file gives one (llama.cpp assumes 4096 for the
        # 64-layer 32B), RoPE only in those layers then
        exaone_window = 0
        if arch == "exaone4":
            default = 4096 if n_layers == 64 else 0
            exaone_window = int(metadata.get("exaone4.attention.sliding_window", default))
        cohere2 = arch == "cohere2"  # llama.cpp's swa pattern 4: RoPE only in the windowed layers
        every_fourth_full = olmo or exaone_window > 0 or cohere2
        window = int(key("attention.sliding_window", 0)) if arch in _WINDOWED else 0
        experts = int(metadata.get(f"{arch}.expert_count", 0))
        ff = int(key("feed_forward_length", 0)) if arch in _MOE_ONLY else int(key("feed_forward_length"))
        dense_ff = ff
        if experts:
            ff = int(metadata.get(f"{arch}.expert_feed_forward_length", ff))
        # a shared expert: its own length (Qwen2-MoE), or a count of expert-sized ones (GLM-4.5)
        shared_ff = int(key("expert_shared_feed_forward_length", 0))
        shared_ff = shared_ff or ff * int(key("expert_shared_count", 0))
        if arch == "ernie4_5-moe" and int(key("expert_shared_count", 0)):
            # ERNIE 4.5 MoE's shared experts are one FFN of count x the experts' length (transformers'
            # moe_num_shared_experts); llama.cpp's converter writes intermediate_size // num_key_value_heads
            # as its length, which only the released shapes make equal
            shared_ff = ff * int(key("expert_shared_count"))
        leading_dense = int(key("leading_dense_block_count", 0)) if experts else 0
        # Hearth's key for Qwen3-Next's dense layers among the experts' (llama.cpp's qwen3next has none)
        dense_layers = tuple(int(i) for i in key("mlp_only_layers", ())) if experts else ()
        if experts and arch == "ernie4_5-moe":  # llama.cpp's: experts in every step-th layer past the leading
            step = int(key("interleave_moe_layer_step", 1))
            skipped = {i for i in range(leading_dense, n_layers) if (i + 1) % step}
            dense_layers = tuple(sorted(skipped | set(dense_layers)))
        temperature = float(key("attention.temperature_scale", 0.0))
        qwen35 = _qwen35_from_gguf(arch, key, n_layers) | _granitehybrid_from_gguf(arch, key, n_layers)
        return cls(
            hidden_size=hidden,
            intermediate_size=ff,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(kv_heads),
            vocab_size=vocab_size,
            # Cohere's LayerNorms keep their epsilon under llama.cpp's layer_norm_epsilon
            rms_norm_eps=float(key("attention.layer_norm_epsilon" if arch in COHERE_ARCHS
                                   else "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 4096)),
            head_dim=head_dim,
            rotary_dim=int(key("rope.dimension_count", head_dim)),
            rope_neox=arch in _NEOX_ROPE,
            rope_scaling=scaling,
            architecture=arch,
            num_experts=experts,
            num_experts_per_tok=int(key("expert_used_count")) if experts else 0,
            # llama.cpp's Mixtral and Qwen3-MoE graphs renormalize (gpt-oss's softmax over the chosen
            # experts' logits is the same numbers), its Qwen2-MoE graph does not (Qwen1.5-MoE's and
            # Qwen2-57B-A14B's norm_topk_prob false); Hearth's converter writes the key
            norm_topk_prob=bool(metadata.get(f"{arch}.expert_weights_norm", arch != "qwen2moe")),
            shared_expert_intermediate_size=shared_ff if experts else 0,
            # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
            expert_gating="sigmoid" if int(key("expert_gating_func", 1)) == 2 else "softmax",
            expert_weights_scale=float(key("expert_weights_scale", 1.0)),
            expert_groups=int(key("expert_group_count", 1)),
            expert_groups_used=int(key("expert_group_used_count", 0)),
            first_dense_layers=leading_dense,
            dense_intermediate_size=dense_ff if leading_dense or dense_layers else 0,
            dense_layers=dense_layers,
            expert_act="swiglu_oai" if gpt_oss else "silu",
            # llama.cpp fixes gpt-oss's 1.702 and 7.0; Hearth's converter writes other values under these keys
            swiglu_alpha=float(key("expert_swiglu_alpha", 1.702)),
            swiglu_limit=float(key("expert_swiglu_limit", 7.0)),
            # a window on gpt-oss's even layers (llama.cpp's swa pattern 2, transformers' layer_types), on
            # every layer of a "llama" that has one (Mistral v0.1, as Hearth's converter writes it)
            sliding_window=exaone_window or window,
            layer_types=(
                gpt_oss_layer_types(n_layers) if gpt_oss else olmo3_layer_types(n_layers) if every_fourth_full
                else conv_types or qwen35.pop("layer_types", None)
            ),
            conv_taps=int(key("shortconv.l_cache", 0)),
            # OLMo 3 (llama.cpp's olmo2 with a window): plain RoPE in the windowed layers, as transformers
            window_rope_unscaled=olmo,
            # llama.cpp fixes SmolLM3's NoPE layers at every fourth (no GGUF key)
            rope_layers=(
                qwen35.pop("rope_layers") if "rope_layers" in qwen35
                else smollm3_rope_layers(n_layers) if arch == "smollm3"
                else windowed_rope_layers(olmo3_layer_types(n_layers)) if exaone_window or cohere2
                else None
            ),
            embedding_multiplier=float(key("embedding_scale", 1.0)),
            residual_multiplier=float(key("residual_scale", 1.0)),
            attention_multiplier=float(key("attention.scale", 0.0)),
            # one key, two meanings: Granite divides its logits by it, Cohere multiplies them
            logits_scaling=1.0 if arch in COHERE_ARCHS else float(key("logit_scale", 1.0)),
            logit_scale=float(key("logit_scale", 1.0)) if arch in COHERE_ARCHS else 1.0,
            deepstack_layers=int(key("n_deepstack_layers", 0)),
            # llama.cpp's Ministral 3: the temperature over YaRN's original context
            attn_temperature_beta=temperature,
            attn_temperature_length=scaling.original_max_position if temperature else 0,
            **qwen35,
        )


def _qwen35_from_gguf(arch: str, key, n_layers: int) -> dict:
    """llama.cpp's qwen35 and qwen3next keys as LlamaConfig fields: DeltaNet layers but every
    full_attention_interval-th, their sizes (ssm.*; value heads in llama.cpp's tiled order for qwen35, grouped
    by key head as HF keeps them for qwen3next), gated attention."""
    if arch not in ("qwen35", "qwen35moe", "qwen3next"):
        return {}
    every = int(key("full_attention_interval", 4))
    v_heads = int(key("ssm.time_step_rank"))
    return {
        "layer_types": qwen35_layer_types(n_layers, every),
        "delta": DeltaShape(
            k_heads=int(key("ssm.group_count")),
            v_heads=v_heads,
            head_k=int(key("ssm.state_size")),
            head_v=int(key("ssm.inner_size")) // v_heads,
            taps=int(key("ssm.conv_kernel")),
            tiled=arch != "qwen3next",
        ),
        "attn_output_gate": True,
    }


def _granitehybrid_from_gguf(arch: str, key, n_layers: int) -> dict:
    """llama.cpp's granitehybrid keys as LlamaConfig fields: Mamba-2's sizes (ssm.*), and no RoPE unless
    rope.scaling.finetuned says so (Granite 4.0-H attends without positions)."""
    if arch != "granitehybrid":
        return {}
    heads = int(key("ssm.time_step_rank"))
    return {
        "mamba": MambaShape(
            heads=heads, head_dim=int(key("ssm.inner_size")) // heads, state_size=int(key("ssm.state_size")),
            groups=int(key("ssm.group_count")), taps=int(key("ssm.conv_kernel")),
        ),
        "rope_layers": None if bool(key("rope.scaling.finetuned", False)) else (False,) * n_layers,
    }


def qwen35_layer_types(n_layers: int, every: int = 4) -> tuple[str, ...]:
    """Qwen3.5's layers: a gated DeltaNet in all but every `every`-th, which attends."""
    return tuple("linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers))


def smollm3_rope_layers(n_layers: int, interval: int = 4) -> tuple[bool, ...]:
    """SmolLM3's RoPE flags: every `interval`-th layer (the 4th, 8th, ...) attends without positions."""
    return tuple((i + 1) % interval != 0 for i in range(n_layers))


def windowed_rope_layers(layer_types) -> tuple[bool, ...]:
    """EXAONE 4 with a window: RoPE in the windowed layers only (the full ones attend without positions)."""
    return tuple(t == "sliding_attention" for t in layer_types)


def olmo3_layer_types(n_layers: int) -> tuple[str, ...]:
    """OLMo 3's layers (llama.cpp's swa pattern 4, transformers' default): a window on three of every four."""
    return tuple("sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers))


def gpt_oss_layer_types(n_layers: int) -> tuple[str, ...]:
    """gpt-oss's layers: sliding-window attention on the even ones, full on the odd ones."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers))


@dataclass
class LlamaLayer:
    attn_norm: np.ndarray | None  # (hidden,); None: the branch takes the residual stream as is (OLMo 2)
    wq: Weight | None  # (q_dim, hidden); None in a convolution or DeltaNet layer, as wk, wv and wo
    wk: Weight | None  # (kv_dim, hidden)
    wv: Weight | None  # (kv_dim, hidden)
    wo: Weight | None  # (hidden, q_dim)
    ffn_norm: np.ndarray | None  # (hidden,)
    w_gate: Weight | None  # (ffn, hidden); None in a mixture-of-experts layer
    w_up: Weight | None  # (ffn, hidden)
    w_down: Weight | None  # (hidden, ffn)
    bq: np.ndarray | None = None  # optional QKV biases (Qwen2)
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    # optional RMSNorm of q and k before RoPE: per head (Qwen3, (head_dim,)) or over the whole projection
    # (OLMo 2, (q_dim,) and (kv_dim,))
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    moe: MoE | None = None  # the experts that replace gate/up/down (Mixtral, Qwen2/3-MoE, gpt-oss)
    bo: np.ndarray | None = None  # attention output bias (gpt-oss), (hidden,)
    sinks: np.ndarray | None = None  # attention-sink logits per query head (gpt-oss), (n_heads,)
    # RMSNorm of the attention and FFN outputs before the residual add (GLM-4's "sandwich" norms), (hidden,)
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None
    conv: ShortConv | None = None  # LFM2's short convolution in place of attention
    delta: DeltaNet | None = None  # Qwen3.5's gated DeltaNet in place of attention
    mamba: Mamba2 | None = None  # Granite 4.0-H's Mamba-2 in place of attention


def _attention_weights(weights, p: str, q: int, kv: int, d: int) -> tuple[Weight, Weight, Weight]:
    """q, k, v projections: separate tensors, or row blocks of a fused attn_qkv (Phi-3)."""
    if weights.has(p + "attn_qkv.weight"):
        fused = weights.matrix(p + "attn_qkv.weight", q + 2 * kv, d)
        return fused.row_block(0, q), fused.row_block(q, q + kv), fused.row_block(q + kv, q + 2 * kv)
    return (
        weights.matrix(p + "attn_q.weight", q, d),
        weights.matrix(p + "attn_k.weight", kv, d),
        weights.matrix(p + "attn_v.weight", kv, d),
    )


def _ffn_weights(weights, p: str, ff: int, d: int) -> tuple[Weight, Weight]:
    """gate and up projections: separate, or one ffn_up of 2*ff rows holding gate then up (Phi-3)."""
    if not weights.has(p + "ffn_gate.weight") and weights.has(p + "ffn_up.weight"):
        fused = weights.matrix(p + "ffn_up.weight", 2 * ff, d)
        return fused.row_block(0, ff), fused.row_block(ff, 2 * ff)
    return weights.matrix(p + "ffn_gate.weight", ff, d), weights.matrix(p + "ffn_up.weight", ff, d)


@register(
    "llama", "mistral", "mistral3", "smollm3", "granite", "glm4", "olmo2", "ernie4_5", "ernie4_5-moe",
    "qwen2", "qwen2moe", "qwen3", "qwen3moe", "glm4moe", "exaone4", "seed_oss", "phi3", "gpt-oss", "lfm2",
    "lfm2moe", "qwen35", "qwen35moe", "qwen3next", "granitehybrid", "qwen3vl", "qwen3vlmoe", "qwen2vl",
    "command-r", "cohere2",
)
class LlamaModel(Decoder):
    """A Llama-family decoder over weights that stay in their file format."""

    config_class = LlamaConfig
    # the images this model can embed (engine.vision.tokens.ImageTable), set by a vision tower's attach()
    # (Mistral 3's Pixtral)
    images = None
    # Qwen3.5, Qwen3-VL, Qwen2.5-VL and Qwen2-VL with their vision tower: (3, rotary pairs) masks of the pairs
    # M-RoPE turns by t, h, w (set by the tower's attach(); its table gives the positions:
    # engine.vision.qwen35)
    mrope = None

    def __init__(self, cfg: LlamaConfig, weights):
        """Args: cfg; weights: a weight source with matrix(name, rows, cols), vector(name, n), has(name)."""
        self.cfg = cfg
        d, q, kv, ff = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
        self.token_embd = weights.matrix("token_embd.weight", cfg.vocab_size, d)
        # LFM2 names its final norm token_embd_norm (HF's embedding_norm), though it norms the last output
        final_norm = "output_norm.weight" if weights.has("output_norm.weight") else "token_embd_norm.weight"
        self.output_norm = weights.vector(final_norm, d)
        # Tied embeddings: small models reuse the input embedding as the output projection.
        self.output = (
            weights.matrix("output.weight", cfg.vocab_size, d)
            if weights.has("output.weight")
            else self.token_embd
        )
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"blk.{i}."

            def optional(name, n, p=p):
                return weights.vector(p + name, n) if weights.has(p + name) else None

            conv = load_shortconv(weights, p, d, cfg.conv_taps) if cfg.is_conv(i) else None
            recurrent = cfg.is_recurrent(i)
            delta = load_deltanet(weights, p, d, cfg.delta) if recurrent and cfg.delta else None
            mamba = load_mamba2(weights, p, d, cfg.mamba) if recurrent and cfg.mamba else None
            attends = conv is None and not recurrent
            # Qwen3.5's gated attention: q_proj gives each head's query then its output gate
            q_rows = 2 * q if cfg.attn_output_gate else q
            wq, wk, wv = _attention_weights(weights, p, q_rows, kv, d) if attends else (None, None, None)
            moe = None
            if cfg.has_experts(i):
                moe = load_moe(weights, p, cfg.num_experts, ff, d, cfg.shared_expert_intermediate_size)
            layer_ff = ff if not cfg.num_experts or moe is not None else cfg.dense_intermediate_size or ff
            # llama.cpp's gpt-oss names the pre-FFN norm post_attention_norm; its sinks may lack ".weight".
            # Beside an ffn_norm (GLM-4), post_attention_norm norms the attention output
            attn_norm, ffn_norm = "attn_norm.weight", "ffn_norm.weight"
            post_attn = "post_attention_norm.weight"
            if cfg.post_norm_only:
                attn_norm = ffn_norm = ""
            elif cfg.parallel_block:  # Cohere: attn_norm's output feeds the FFN too
                ffn_norm = post_attn = ""
            elif not weights.has(p + ffn_norm):
                ffn_norm, post_attn = post_attn, ""
            qk_norm = (q, kv) if cfg.qk_norm_full else (cfg.head_dim, cfg.head_dim)
            if cfg.parallel_block and weights.has(p + "attn_q_norm.weight"):
                # Command R+: a LayerNorm per head, with weights per head ((heads, head_dim), flattened)
                heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
                q_norm = weights.floats(p + "attn_q_norm.weight", (heads, hd)).reshape(q)
                k_norm = weights.floats(p + "attn_k_norm.weight", (kv_heads, hd)).reshape(kv)
            else:
                q_norm = optional("attn_q_norm.weight", qk_norm[0])
                k_norm = optional("attn_k_norm.weight", qk_norm[1])
            sinks = next((s for s in ("attn_sinks.weight", "attn_sinks") if weights.has(p + s)), None)
            w_gate, w_up = _ffn_weights(weights, p, layer_ff, d) if moe is None else (None, None)
            self.layers.append(
                LlamaLayer(
                    attn_norm=weights.vector(p + attn_norm, d) if attn_norm else None,
                    wq=wq,
                    wk=wk,
                    wv=wv,
                    wo=weights.matrix(p + "attn_output.weight", d, q) if attends else None,
                    ffn_norm=weights.vector(p + ffn_norm, d) if ffn_norm else None,
                    w_gate=w_gate,
                    w_up=w_up,
                    w_down=weights.matrix(p + "ffn_down.weight", d, layer_ff) if moe is None else None,
                    bq=optional("attn_q.bias", q),
                    bk=optional("attn_k.bias", kv),
                    bv=optional("attn_v.bias", kv),
                    q_norm=q_norm,
                    k_norm=k_norm,
                    moe=moe,
                    bo=optional("attn_output.bias", d),
                    sinks=None if sinks is None else weights.vector(p + sinks, cfg.num_attention_heads),
                    post_attn_norm=optional(post_attn, d) if post_attn else None,
                    post_ffn_norm=optional("post_ffw_norm.weight", d),
                    conv=conv,
                    delta=delta,
                    mamba=mamba,
                )
            )
        half = cfg.rotary_dim // 2
        freq_factors = weights.vector("rope_freqs.weight", half) if weights.has("rope_freqs.weight") else None
        if weights.has("rope_factors_short.weight") and not cfg.rope_scaling.short_factor:
            # llama.cpp's Phi-3 LongRoPE: the factors as tensors, the rest in rope.scaling keys
            cfg.rope_scaling = dataclasses.replace(
                cfg.rope_scaling,
                kind="longrope",
                short_factor=tuple(weights.vector("rope_factors_short.weight", half).tolist()),
                long_factor=tuple(weights.vector("rope_factors_long.weight", half).tolist()),
            )
        self.inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, freq_factors)
        # LongRoPE's long factors, for caches past the original context (rope_freqs)
        self._long_freq = None
        if cfg.rope_scaling.kind == "longrope":
            n_long = cfg.rope_scaling.original_max_position + 1
            self._long_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, n_ctx=n_long)
        # YaRN and LongRoPE scale cos and sin by an attention factor: a fully rotated head's logits by its
        # square (folded into the scale: every backend gets it); a partly rotated one (Phi-4-mini) only in
        # its rotated dims, scaled after RoPE (rope_mscale)
        factor = rope_attention_factor(cfg.rope_scaling)
        full = cfg.rotary_dim == cfg.head_dim
        self.rope_mscale = np.float32(1.0 if full else factor)
        base = cfg.attention_multiplier or 1.0 / np.sqrt(cfg.head_dim)  # Granite's own scale, else 1/sqrt(d)
        self.scale = np.float32((factor**2 if full else 1.0) * base)
        # OLMo 3's windowed layers rotate with plain RoPE and no attention factor (the full layers scale)
        self._plain_rope = None
        if cfg.window_rope_unscaled and cfg.rope_scaling.kind != "none" and full:
            plain = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, RopeScaling())
            self._plain_rope = (plain, np.float32(base))
        self._decode = Scratch(cfg, 1)
        self._logits = np.empty((1, cfg.vocab_size), np.float32)
        self._ones_head = np.ones(cfg.head_dim, np.float32)  # Command R+'s per-head norms' unit weights

    def new_cache(self, n_ctx: int, dtype=np.float32) -> KVCache:
        """An empty cache for n_ctx positions: with LFM2's convolution layers one that keeps their inputs,
        with Qwen3.5's DeltaNet layers one that keeps their state."""
        cfg = self.cfg
        n_conv, n_rec = cfg.n_conv_layers, cfg.n_recurrent_layers
        n_attn, kv_heads, d = cfg.num_hidden_layers - n_conv - n_rec, cfg.num_key_value_heads, cfg.hidden_size
        if n_rec:
            shapes = cfg.recurrent_shapes
            return RecurrentKVCache(n_attn, kv_heads, cfg.head_dim, n_ctx, dtype, n_rec, *shapes)
        if not n_conv:
            return super().new_cache(n_ctx, dtype)
        return ShortConvKVCache(n_attn, kv_heads, cfg.head_dim, n_ctx, dtype, n_conv, d)

    def _plain(self, i: int) -> bool:
        # layer i rotates with plain RoPE (OLMo 3's windowed layers of a model with scaled RoPE)
        return self._plain_rope is not None and self.cfg.window(i) is not None

    def _scale_of(self, i: int) -> np.float32:
        """Layer i's attention scale."""
        return self._plain_rope[1] if self._plain(i) else self.scale

    def rope_freqs(self, n_ctx: int) -> np.ndarray:
        """The RoPE frequencies for a cache of n_ctx positions: LongRoPE models take their long factors
        for a context past the original one (llama.cpp's choice, fixed for the cache), the others one set."""
        if self._long_freq is not None and n_ctx > self.cfg.rope_scaling.original_max_position:
            return self._long_freq
        return self.inv_freq

    def _forward(self, tokens: np.ndarray, cache: KVCache, all_logits: bool, first: int = 0, hidden=None):
        cfg = self.cfg
        n = len(tokens)
        s = self._run(tokens, cache, first, hidden)
        if all_logits:
            self._norm(s.h, s.x, self.output_norm)
            logits = np.empty((n, cfg.vocab_size), np.float32)
            ops.linear(logits, self.output, s.h)
            return self._scale_logits(logits)
        last = s.h[n - 1 : n]
        self._norm(last, s.x[n - 1 : n], self.output_norm)
        ops.linear(self._logits, self.output, last)
        return self._scale_logits(self._logits)

    def hidden_states(self, tokens) -> np.ndarray:
        """The final hidden states (n, hidden_size) float32 of one sequence of token ids (n,): the last
        layer's output after the final norm (transformers' last_hidden_state), in a cache of its own.
        Embeddings pool these rows (engine.embed); the decode path never comes here."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        cache = self.new_cache(len(tokens))
        with ops.batch_phase(len(tokens), self.small_batch_max):
            s = self._run(tokens, cache)
            out = np.empty((len(tokens), self.cfg.hidden_size), np.float32)
            self._norm(out, s.x, self.output_norm)
        return out

    def _run(self, tokens: np.ndarray, cache: KVCache, first: int = 0, hidden=None) -> Scratch:
        """Run tokens through the layers (from `first`) into the cache; the scratch whose x holds the last
        layer's output, before the final norm."""
        cfg = self.cfg
        n = len(tokens)
        s = self._decode if n == 1 else Scratch(cfg, n)
        pos0 = cache.offset
        s.positions[:] = np.arange(pos0, pos0 + n)
        s.axes = self._mrope_axes(s, cache, tokens)

        def attend(i, attn3, q3, k3, v3):
            k_cache, v_cache = cache.update_and_fetch(cfg.cache_slot(i, first), k3, v3)
            sinks = self.layers[i].sinks
            scale = self._scale_of(i)
            ops.attention(attn3, q3, k_cache, v_cache, pos0, scale, cfg.window(i), sinks=sinks)

        def conv_mix(i, out, bx):
            history = cache.conv_history(cfg.cache_slot(i, first), bx)
            convolve(out, history, pos0, self.layers[i].conv.kernel)

        def delta_mix(i, *projections):
            return cache.mix(cfg.cache_slot(i, first), partial(self._recurrent_mix, i), projections)

        # a recurrent cache keeps states to return to (RecurrentKVCache.trim): a pass's start and its end - 1
        with cache.forward_pass(tokens):
            self._layers(s, tokens, attend, first, hidden, self.rope_freqs(cache.n_ctx), conv_mix, delta_mix)
        return s

    def _mrope_axes(self, s: Scratch, cache: KVCache, tokens: np.ndarray) -> np.ndarray | None:
        """With M-RoPE and images held: s.positions becomes the pass's text positions (past an image they
        are no longer the cache's index) and the result its (3, n) t, h, w positions where they differ (an
        image's rows); None where one position per row serves."""
        if self.mrope is None or not self.images.any_held():
            return None
        axes = self.images.cache_positions(cache, tokens)
        s.positions[:] = axes[0]
        return axes if (axes[1:] != axes[0]).any() else None

    def _scale_logits(self, logits: np.ndarray) -> np.ndarray:
        if self.cfg.logits_scaling != 1.0:  # Granite divides its logits
            logits /= np.float32(self.cfg.logits_scaling)
        if self.cfg.logit_scale != 1.0:  # Cohere multiplies them
            logits *= np.float32(self.cfg.logit_scale)
        return logits

    def _norm(self, out: np.ndarray, x: np.ndarray, norm: np.ndarray | None) -> None:
        """out = a branch's input or the final hidden state: x normed by `norm` (RMSNorm, or Cohere's
        LayerNorm), or x itself where there is no norm (OLMo 2 norms outputs only)."""
        if norm is None:
            out[:] = x
        elif self.cfg.parallel_block:
            ops.layernorm(out, x, norm, self.cfg.rms_norm_eps)
        else:
            ops.rmsnorm(out, x, norm, self.cfg.rms_norm_eps)

    def _forward_batch(self, tokens: np.ndarray, caches: list[KVCache], first: int = 0, hidden=None):
        n = len(tokens)
        s, logits = self._batch_buffers(n)
        s.axes = None
        for b, cache in enumerate(caches):
            s.positions[b] = cache.offset
            if self.mrope is not None and self.images.any_held():  # decoded text: the three axes agree
                s.positions[b] = self.images.cache_positions(cache, tokens[b : b + 1])[0, 0]

        def attend(i, attn3, q3, k3, v3):
            # each sequence attends over its own cache, at its own index
            slot = self.cfg.cache_slot(i, first)
            for b, cache in enumerate(caches):
                k_cache, v_cache = cache.update_and_fetch(slot, k3[b : b + 1], v3[b : b + 1])
                pos = cache.offset
                ops.attention(attn3[b : b + 1], q3[b : b + 1], k_cache, v_cache, pos, self._scale_of(i),
                              self.cfg.window(i), sinks=self.layers[i].sinks)

        def conv_mix(i, out, bx):
            slot = self.cfg.cache_slot(i, first)
            for b, cache in enumerate(caches):
                history = cache.conv_history(slot, bx[b : b + 1])
                convolve(out[b : b + 1], history, int(s.positions[b]), self.layers[i].conv.kernel)

        def delta_mix(i, *projections):
            slot = self.cfg.cache_slot(i, first)
            rows = [
                self._recurrent_mix(i, [x[b : b + 1] for x in projections], cache.conv_state[slot],
                                    cache.recurrent[slot])
                for b, cache in enumerate(caches)
            ]
            return np.concatenate(rows)

        # one set of frequencies for the batch: the server's caches share a context length
        freqs = self.rope_freqs(max(c.n_ctx for c in caches))
        self._layers(s, tokens, attend, first, hidden, freqs, conv_mix, delta_mix)
        for b, cache in enumerate(caches):
            cache.advance(tokens[b : b + 1])
        self._norm(s.h, s.x, self.output_norm)
        ops.linear(logits, self.output, s.h)
        return self._scale_logits(logits)

    def _layers(
        self, s: Scratch, tokens: np.ndarray, attend, first: int = 0, hidden=None, inv_freq=None,
        conv_mix=None, delta_mix=None,
    ) -> None:
        """Embed tokens (n,) into s.x (or start from `hidden`, the residual stream entering layer
        `first`) and run the layers from `first` on; s.positions holds each row's position; inv_freq: the
        RoPE frequencies (rope_freqs of the cache; default self.inv_freq, as Gemma's _layers takes none).

        attend(layer index, attn3 out, q3, k3, v3) stores k, v in the cache(s) and writes attn3;
        conv_mix(layer index, out, bx) stores a convolution layer's gated inputs bx (n, hidden) in the
        cache(s) and writes their convolution to out; delta_mix(layer index, qkv, z, b, a) runs a DeltaNet
        layer's projections through its recurrent state(s) and returns out_proj's input.
        """
        cfg = self.cfg
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        images = self.images is not None and tokens.max() >= self.images.base
        # Qwen3-VL: the tower's deepstack sets join the pass's image rows after the first layers
        stack = getattr(self.images, "deepstack", 0) if images else 0
        if hidden is None:
            text = np.where(tokens >= self.images.base, 0, tokens) if images else tokens
            ops.get_rows(s.x, self.token_embd, text)
            if cfg.embedding_multiplier != 1.0:
                s.x *= np.float32(cfg.embedding_multiplier)
            if images:
                self.images.embed(s.x, tokens)  # image rows as the projector gave them
        else:
            s.x[:] = hidden
        residual = np.float32(cfg.residual_multiplier)
        for i, layer in enumerate(self.layers[first:], first):
            self._norm(s.h, s.x, layer.attn_norm)
            if layer.conv is not None:  # LFM2: out_proj(C * conv(B * x))
                bx, c = gated_inputs(s.bcx, layer.conv, s.h)
                conv_mix(i, s.h, bx)
                s.h *= c
                ops.linear(s.o, layer.conv.out_proj, s.h)
            elif layer.delta is not None:  # Qwen3.5: out_proj(gated norm(delta rule(conv(q|k|v))))
                projections = deltanet.project(layer.delta, s.h, cfg.delta)
                ops.linear(s.o, layer.delta.out_proj, delta_mix(i, *projections))
            elif layer.mamba is not None:  # Granite 4.0-H: out_proj(gated norm(scan(conv(x|B|C))))
                ops.linear(s.o, layer.mamba.out_proj, delta_mix(i, *mamba2.project(layer.mamba, s.h)))
            else:
                self._attention(s, i, layer, attend, inv_freq)
            if layer.post_attn_norm is not None:
                ops.rmsnorm(s.o, s.o, layer.post_attn_norm, cfg.rms_norm_eps)
            _add_residual(s.x, s.o, residual)
            if not cfg.parallel_block:  # Cohere's FFN takes the attention's input, still in s.h
                self._norm(s.h, s.x, layer.ffn_norm)
            if layer.moe is not None:
                moe_forward(s.o, s.h, layer.moe, cfg)
            else:
                self._dense_ffn(s, i, layer)
            _add_residual(s.x, s.o, residual)
            if i < stack:
                self.images.add_deepstack(s.x, tokens, i)

    def _dense_ffn(self, s: Scratch, i: int, layer: LlamaLayer) -> None:
        """Layer i's gated FFN: s.h, the normed input, -> s.o (after any output norm)."""
        cfg, capture = self.cfg, self.capture
        if capture is not None:
            capture(i, "ffn_up", s.h)
        gate, up = (s.gate, s.up) if layer.w_gate.rows == s.gate.shape[1] else (s.dense_gate, s.dense_up)
        ops.linear(gate, layer.w_gate, s.h)
        ops.linear(up, layer.w_up, s.h)
        ops.silu_mul(gate, gate, up)
        if capture is not None:
            capture(i, "ffn_down", gate)
        ops.linear(s.o, layer.w_down, gate)
        if layer.post_ffn_norm is not None:
            ops.rmsnorm(s.o, s.o, layer.post_ffn_norm, cfg.rms_norm_eps)

    def _recurrent_mix(self, i: int, projections, conv_state: np.ndarray, state: np.ndarray) -> np.ndarray:
        """Layer i's DeltaNet or Mamba-2 over one sequence's projections (deltanet.project's or
        mamba2.project's), from and into its states; returns out_proj's input."""
        layer, cfg = self.layers[i], self.cfg
        if layer.delta is not None:
            return deltanet.mix(layer.delta, cfg.delta, cfg.rms_norm_eps, *projections, conv_state, state)
        return mamba2.mix(layer.mamba, cfg.mamba, cfg.rms_norm_eps, *projections, conv_state, state)

    def _attention(self, s: Scratch, i: int, layer: LlamaLayer, attend, inv_freq) -> None:
        """Layer i's attention branch (see _layers): s.h, the normed input, -> s.o, before any output norm."""
        cfg = self.cfg
        n, capture = len(s.h), self.capture
        heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q3 = s.q.reshape(n, heads, hd)
        k3 = s.k.reshape(n, kv_heads, hd)
        v3 = s.v.reshape(n, kv_heads, hd)
        attn3 = s.attn.reshape(n, heads, hd)
        if capture is not None:
            capture(i, "attn_q", s.h)
        gate = None
        if cfg.attn_output_gate:  # Qwen3.5: per head its query, then its output gate
            qg = np.empty((n, heads, 2, hd), np.float32)
            ops.linear(qg.reshape(n, 2 * cfg.q_dim), layer.wq, s.h)
            q3[:] = qg[:, :, 0]
            gate = qg[:, :, 1].reshape(n, cfg.q_dim)
        else:
            ops.linear(s.q, layer.wq, s.h)
        ops.linear(s.k, layer.wk, s.h)
        ops.linear(s.v, layer.wv, s.h)
        if layer.bq is not None:
            s.q += layer.bq
        if layer.bk is not None:
            s.k += layer.bk
        if layer.bv is not None:
            s.v += layer.bv
        if layer.q_norm is not None and cfg.parallel_block:
            # Command R+: a LayerNorm of each head (a row of (n * heads, hd)), then weights per head
            for x, norm in ((s.q, layer.q_norm), (s.k, layer.k_norm)):
                rows = x.reshape(-1, hd)
                ops.layernorm(rows, rows, self._ones_head, cfg.rms_norm_eps)
                x *= norm
        elif layer.q_norm is not None:  # per head, or over the whole row (OLMo 2)
            rows_q = s.q.reshape(-1, len(layer.q_norm))
            ops.rmsnorm(rows_q, rows_q, layer.q_norm, cfg.rms_norm_eps)
        if layer.k_norm is not None and not cfg.parallel_block:
            rows_k = s.k.reshape(-1, len(layer.k_norm))
            ops.rmsnorm(rows_k, rows_k, layer.k_norm, cfg.rms_norm_eps)
        if cfg.uses_rope(i):
            freqs = self._plain_rope[0] if self._plain(i) else inv_freq
            axes = getattr(s, "axes", None)
            # M-RoPE: each pair turns by its axis's position (the other axes' pairs at frequency 0 stay)
            turns = [(s.positions, freqs)] if axes is None else [
                (axes[a], (freqs * self.mrope[a]).astype(np.float32)) for a in range(3)
            ]
            for positions, f in turns:
                ops.rope(q3, positions, f, cfg.rotary_dim, cfg.rope_neox)
                ops.rope(k3, positions, f, cfg.rotary_dim, cfg.rope_neox)
            if self.rope_mscale != 1:
                q3[..., : cfg.rotary_dim] *= self.rope_mscale
                k3[..., : cfg.rotary_dim] *= self.rope_mscale
        if cfg.attn_temperature_beta:  # Ministral 3: queries sharpened with the distance from the start
            steps = np.floor(s.positions / cfg.attn_temperature_length)
            q3 *= (1.0 + cfg.attn_temperature_beta * np.log1p(steps)).astype(np.float32)[:, None, None]
        attend(i, attn3, q3, k3, v3)
        if gate is not None:
            s.attn *= 1.0 / (1.0 + np.exp(-gate))
        if capture is not None:
            capture(i, "attn_output", s.attn)
        ops.linear(s.o, layer.wo, s.attn)
        if layer.bo is not None:
            s.o += layer.bo


def _add_residual(x: np.ndarray, branch: np.ndarray, scale: np.float32) -> None:
    """x += branch (times Granite's residual multiplier; branch is scratch, scaled in place)."""
    if scale != 1:
        branch *= scale
    x += branch
