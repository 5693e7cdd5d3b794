"""A Hugging Face folder written one safetensors shard at a time, for the bench scripts' random models.

A model of a real model's layer shapes does not fit in memory whole on a small machine, so each script
writes its layers a shard at a time (`ShardedFolder.write`) and `close` writes the shards' index.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class ShardedFolder:
    """A fresh folder holding `config` as config.json and the tokenizer files of the folder `tokenizer`."""

    def __init__(self, folder: Path, config: dict, tokenizer: Path):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer / name, folder / name)
        self.folder = folder
        self.index: dict[str, str] = {}

    def write(self, file: str, tensors: dict[str, np.ndarray]) -> None:
        """One shard: `file` holding `tensors`."""
        save_file(tensors, str(self.folder / file))
        self.index.update(dict.fromkeys(tensors, file))

    def close(self) -> None:
        """Write model.safetensors.index.json for the shards written."""
        index = {"metadata": {}, "weight_map": self.index}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index))
