"""Model containers: GGUF and safetensors readers (read-only mmap, validated before any view is made)."""

from models.formats.gguf import GGUFFile, TensorInfo, open_gguf
from models.formats.safetensors import SafetensorsModel, STensor, open_safetensors, open_safetensors_repo

__all__ = [
    "GGUFFile",
    "STensor",
    "SafetensorsModel",
    "TensorInfo",
    "open_gguf",
    "open_safetensors",
    "open_safetensors_repo",
]
