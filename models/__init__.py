"""Artifacts: model containers (GGUF, safetensors), starter models, paths. No numba, no Qt."""
