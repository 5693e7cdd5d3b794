"""Partial offload (`--gpu-layers N`, llama.cpp's -ngl): the first N layers on the GPU, the rest on the CPU.

The GPU runs the embedding and layers 0..N-1 (a CudaDecoder built with n_layers=N); the residual
stream of each token, hidden_size floats, crosses to the host, where the CPU model runs layers N..
and the output projection (Decoder.forward_from). Each side keeps the KV cache of its own layers;
HybridKVCache presents the two as one cache to the chat runtime, the prefix store and speculation.
"""

from __future__ import annotations

import numpy as np

from engine.backends.cuda.decoder import CudaDecoder, CudaKVCache
from engine.kv_cache import KVCache, RecurrentKVCache, ShortConvKVCache


class HybridKVCache:
    """A CudaKVCache for the GPU layers and a KVCache for the CPU layers, kept at the same tokens.

    With recurrent layers (Qwen3.5's DeltaNet, Granite 4.0-H's Mamba-2) both halves are RecurrentKVCaches,
    also a half without such a layer: each side's passes keep the same snapshots, so a trim takes both
    back to the same one."""

    def __init__(self, gpu: CudaKVCache, cpu: KVCache):
        self.gpu, self.cpu = gpu, cpu
        self.n_ctx = cpu.n_ctx
        self.dtype = cpu.dtype

    @property
    def partial_states(self) -> bool:
        """As both halves' (KVCache.partial_states): whether every position can be read back."""
        return self.cpu.partial_states

    @property
    def offset(self) -> int:
        return self.cpu.offset

    @property
    def tokens(self) -> list[int]:
        return self.cpu.tokens

    @property
    def nbytes(self) -> int:
        return self.gpu.nbytes + self.cpu.nbytes

    @property
    def bytes_per_token(self) -> int:
        return self.gpu.bytes_per_token + self.cpu.bytes_per_token

    def check_room(self, n: int) -> None:
        self.cpu.check_room(n)

    def advance(self, tokens) -> None:
        tokens = list(tokens)
        self.gpu.advance(tokens)
        self.cpu.advance(tokens)

    def trim(self, n: int) -> int:
        end = self.offset
        self.gpu.trim(n)
        self.cpu.trim(n)
        self.realign()
        return end - self.offset

    def realign(self) -> None:
        """Both halves at the same offset again (after a pass that one side finished and the other did
        not, or trims that went back to different snapshots): the one ahead is trimmed back to the other,
        until they meet (a recurrent half may go back further, to a snapshot)."""
        while self.gpu.offset != self.cpu.offset:
            ahead, behind = sorted((self.gpu, self.cpu), key=lambda c: c.offset, reverse=True)
            ahead.trim(ahead.offset - behind.offset)

    def common_prefix(self, tokens) -> int:
        return self.cpu.common_prefix(tokens)

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """Each array of the halves' reads (keys, values, and LFM2's convolution inputs), the GPU's layers
        first."""
        return tuple(np.concatenate(pair) for pair in zip(self.gpu.read(lo, hi), self.cpu.read(lo, hi)))

    def write(self, lo: int, *arrays: np.ndarray) -> None:
        firsts = [self.gpu.k.shape[0], self.gpu.v.shape[0]]
        if len(arrays) > 2:  # LFM2's convolution inputs
            firsts.append(self.gpu.conv.shape[0])
        self.gpu.write(lo, *(a[:n] for a, n in zip(arrays, firsts)))
        self.cpu.write(lo, *(a[n:] for a, n in zip(arrays, firsts)))

    def update_and_fetch(self, layer, k, v):
        raise NotImplementedError("HybridKVCache is written through its gpu and cpu parts")


class HybridDecoder:
    """A decoder whose first n_gpu_layers layers run on the GPU and the others on the CPU.

    Args:
        model: the CPU model built from the file (LlamaModel, Gemma3Model or NemotronHModel).
        n_gpu_layers: layers on the GPU, 1 <= n < the model's layer count.
        device, n_ctx, prefill_dtype, progress, use_graphs, decode_kernel: as CudaDecoder's.

    Raises:
        UnsupportedCudaModelError, CudaOutOfMemoryError: as CudaDecoder.
    """

    def __init__(self, model, n_gpu_layers: int, device: int = 0, n_ctx: int = 4096,
                 prefill_dtype: str = "float16", progress=None, use_graphs: bool = True,
                 decode_kernel: str | None = None):
        n_all = model.cfg.num_hidden_layers
        if not 1 <= n_gpu_layers < n_all:
            raise ValueError(f"n_gpu_layers must be 1..{n_all - 1} for a hybrid decoder, got {n_gpu_layers}")
        self.cpu = model
        self.gpu = CudaDecoder(model, device=device, n_ctx=n_ctx, prefill_dtype=prefill_dtype,
                               progress=progress, use_graphs=use_graphs, n_layers=n_gpu_layers,
                               decode_kernel=decode_kernel)
        self.n_gpu_layers = n_gpu_layers
        self.cfg = model.cfg
        self.device = self.gpu.device
        self.max_position_embeddings = model.cfg.max_position_embeddings
        self.weight_bytes = self.gpu.weight_bytes

    @property
    def placement(self) -> str:
        """Where the model runs, for status lines: "cuda:N (n/total layers)"."""
        return f"cuda:{self.device} ({self.n_gpu_layers}/{self.cfg.num_hidden_layers} layers)"

    def cache_bytes(self, n_ctx: int, dtype=np.float16) -> int:
        """GPU bytes of one more sequence (CudaDecoder.cache_bytes of the GPU's layers; the CPU layers'
        caches are in RAM)."""
        return self.gpu.cache_bytes(n_ctx, dtype)

    def caches_that_fit(self, n_ctx: int, dtype=np.float16) -> int:
        """As CudaDecoder.caches_that_fit, for the GPU's layers."""
        return self.gpu.caches_that_fit(n_ctx, dtype)

    def new_cache(self, n_ctx: int, dtype=np.float32) -> HybridKVCache:
        cfg = self.cfg
        n_cpu = cfg.num_hidden_layers - self.n_gpu_layers
        heads = (cfg.num_key_value_heads, cfg.head_dim, n_ctx, dtype)
        on_cpu = range(self.n_gpu_layers, cfg.num_hidden_layers)
        if self.gpu.conv_cache:  # LFM2: the CPU layers' attention and convolution layers
            n_conv = sum(map(cfg.is_conv, on_cpu))
            cpu = ShortConvKVCache(sum(map(cfg.keeps_kv, on_cpu)), *heads, n_conv, cfg.hidden_size)
        elif self.gpu.rec_cache:  # Qwen3.5, Granite 4.0-H, Nemotron-H: the CPU's attention, recurrent layers
            n_rec = sum(map(cfg.is_recurrent, on_cpu))
            cpu = RecurrentKVCache(sum(map(cfg.keeps_kv, on_cpu)), *heads, n_rec, *cfg.recurrent_shapes)
        else:
            cpu = KVCache(n_cpu, *heads)
        return HybridKVCache(self.gpu.new_cache(n_ctx, dtype), cpu)

    def forward(self, tokens, cache: HybridKVCache, all_logits: bool = False) -> np.ndarray:
        """As Decoder.forward: float32 logits (n, vocab) when all_logits, else (1, vocab)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        cache.check_room(len(tokens))
        try:
            hidden = self.gpu.hidden(tokens, cache.gpu)
            return self.cpu.forward_from(self.n_gpu_layers, hidden, tokens, cache.cpu, all_logits)
        except BaseException:
            cache.realign()  # the half that failed rewound itself (KVCache.forward_pass): the other follows
            raise

    def forward_batch(self, tokens, caches: list[HybridKVCache]) -> np.ndarray:
        """As Decoder.forward_batch: the GPU layers per sequence, the CPU layers batched."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        try:
            hidden = self.gpu.hidden_batch(tokens, [c.gpu for c in caches])
            return self.cpu.forward_batch_from(self.n_gpu_layers, hidden, tokens, [c.cpu for c in caches])
        except BaseException:
            for c in caches:  # the half that failed rewound (rewound_on_failure): the other follows
                c.realign()
            raise
