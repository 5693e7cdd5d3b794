"""Memory-fit estimates: KV bytes per token from GGUF metadata, verdicts, remote estimates."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models import fit
from models.errors import ModelFormatError
from models.fit import MemoryInfo
from models.formats.gguf import open_gguf
from tests.models.test_library import write_gguf

GIB = 2**30
BIG = MemoryInfo(total_ram=16 * GIB, available_ram=12 * GIB)


def test_kv_bytes_per_token_of_smollm2(smollm2_path):
    with open_gguf(smollm2_path) as g:
        # 30 layers * 3 KV heads * (64 key + 64 value) * 4 bytes (float32)
        assert fit.kv_bytes_per_token(g.metadata) == 30 * 3 * 128 * 4 == 46080
    est = fit.fit_for_file(smollm2_path, 4096, memory=BIG)
    assert est.kv_cache == 46080 * 4096 and est.weights == smollm2_path.stat().st_size
    assert est.verdict == "fits" and not est.kv_estimated
    assert "fits: needs" in est.summary() and "4096 tokens" in est.summary()
    with_draft = fit.fit_for_file(smollm2_path, 4096, draft_path=smollm2_path, memory=BIG)
    assert (
        with_draft.draft == est.weights + est.kv_cache and with_draft.needed == est.needed + with_draft.draft
    )
    assert "draft" in with_draft.summary()


def test_metadata_variants():
    meta = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 3,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": np.array([1, 2, 1]),
        "gemma3.attention.key_length": 256,
        "gemma3.embedding_length": 640,
    }
    assert fit.kv_bytes_per_token(meta) == (1 + 2 + 1) * 512 * 4
    del meta["gemma3.attention.key_length"]
    assert fit.kv_bytes_per_token(meta) == 4 * (160 + 160) * 4, "head dim from embedding_length / head_count"
    meta["gemma3.attention.head_count_kv"] = [1, 2]
    with pytest.raises(ModelFormatError, match="per-layer"):
        fit.kv_bytes_per_token(meta)
    with pytest.raises(ModelFormatError, match="block_count is missing"):
        fit.kv_bytes_per_token({"general.architecture": "llama"})
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert fit.kv_bytes_per_token_config(config) == 46080
    with pytest.raises(ModelFormatError):
        fit.kv_bytes_per_token_config({"hidden_size": 5})


def test_label_follows_the_device():
    mem = MemoryInfo(total_ram=8 * GIB, available_ram=4 * GIB, total_vram=24 * GIB, free_vram=20 * GIB)
    big = fit.estimate_fit(8 * GIB, 0, 4096, memory=mem)  # too large for RAM, fits the GPU
    assert fit.label(big, "cpu") == "too large" and fit.label(big, "cuda:0") == "fits (GPU)"
    no_gpu = fit.estimate_fit(8 * GIB, 0, 4096, memory=MemoryInfo(total_ram=8 * GIB, available_ram=4 * GIB))
    assert fit.label(no_gpu, "cuda") == "too large"  # no GPU found: the RAM verdict (it runs on the CPU)


def test_verdicts_and_vram():
    small = MemoryInfo(total_ram=8 * GIB, available_ram=4 * GIB, total_vram=24 * GIB, free_vram=20 * GIB)
    assert fit.estimate_fit(2 * GIB, 0, 1, memory=small).verdict == "fits"
    tight = fit.estimate_fit(6 * GIB, 0, 1, memory=small)
    assert tight.verdict == "tight" and tight.vram_verdict == "fits" and "GPU: fits" in tight.summary()
    assert fit.estimate_fit(8 * GIB, 0, 1, memory=small).verdict == "too large"
    long_ctx = fit.estimate_fit(1 * GIB, 46080, 131072, memory=small)
    assert long_ctx.kv_cache == 46080 * 131072 and long_ctx.verdict == "tight"
    with pytest.raises(ValueError):
        fit.estimate_fit(1, 1, 0, memory=small)
    mem = fit.system_memory()
    assert mem.total_ram >= mem.available_ram > 0


def test_remote_estimate_says_so(smollm2_path):
    size = smollm2_path.stat().st_size
    est = fit.fit_for_remote(size, 4096, "Q4_1", memory=BIG)
    assert est.kv_estimated and "estimated from the file size" in est.summary()
    real = 46080
    per_token = est.kv_cache // 4096
    assert real * 0.8 < per_token < real * 2, per_token
    with open_gguf(smollm2_path) as g:
        exact = fit.fit_for_remote(size, 4096, "Q4_1", metadata=g.metadata, memory=BIG)
    assert not exact.kv_estimated and exact.kv_cache == real * 4096
    draft = fit.fit_for_remote(size, 4096, "Q4_1", draft_size=size // 2, draft_quant="Q8_0", memory=BIG)
    assert draft.draft > size // 2
    assert fit.bits_per_weight("Q4_K_M") == 4.5 and fit.bits_per_weight("Q4_1") == 5.0
    assert fit.bits_per_weight("q8_0") == 8.5 and fit.bits_per_weight(None) == 16.0


def test_fit_for_safetensors_folder(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((4, 8), dtype=np.float16)}, str(tmp_path / "model.safetensors"))
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 32,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    est = fit.fit_for_file(tmp_path, 64, memory=BIG)
    assert est.kv_cache == 2 * 4 * 2 * 8 * 4 * 64
    gguf_path = write_gguf(tmp_path / "g.gguf", n_layer=2, kv_heads=2)
    assert fit.fit_for_file(gguf_path, 10, memory=BIG).kv_cache == 2 * 2 * 32 * 4 * 10
