"""Turn a model file into a ready model: weights mapped, tokenizer and chat template built."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.arch import model_class
from engine.backends import cpu
from engine.chat_template import ChatTemplate
from engine.embed import embedding_spec
from engine.errors import MissingTensorError, ModelFormatError
from engine.hf_repo import is_hf_repo, open_hf_repo
from engine.tokenizer import Tokenizer
from engine.weights import Weight, float32_of
from models.errors import ModelNotFoundError
from models.formats.ggml_types import type_name
from models.formats.gguf import GGUFFile, open_gguf

BF16 = 30  # ggml type id


class GGUFWeights:
    """Weights of an open GGUF file, handed to an architecture by canonical name and checked shape."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, for sizes the metadata does not give (Gemma 3n's LAuReL rank). Raises
        MissingTensorError when the file lacks it."""
        info = self.gguf.tensors.get(name)
        if info is None:
            raise MissingTensorError(self.gguf.path, f"tensor {name!r} is missing; the file is incomplete")
        return tuple(int(n) for n in info.shape)

    def _info(self, name: str, shape: tuple[int, ...]):
        info = self.gguf.tensors.get(name)
        if info is None:
            raise MissingTensorError(
                self.gguf.path,
                f"tensor {name!r} is missing; the file is incomplete or not a {self.gguf.architecture} model",
            )
        if tuple(info.shape) != shape:
            raise MissingTensorError(
                self.gguf.path, f"tensor {name!r} has shape {tuple(info.shape)}, expected {shape}"
            )
        return info

    def _weight(self, name: str, shape: tuple[int, ...]) -> Weight:
        info = self._info(name, shape)
        if info.ggml_type not in cpu.SUPPORTED_TYPES:
            raise ModelFormatError(
                self.gguf.path,
                f"tensor {name!r} uses weight type {type_name(info.ggml_type)}, which this version of "
                f"Hearth cannot compute with yet; pick another quantization (e.g. Q4_0, Q8_0, F16)",
            )
        return Weight(info.ggml_type, info.raw(), int(np.prod(shape[:-1])), shape[-1])

    def matrix(self, name: str, rows: int, cols: int) -> Weight:
        return self._weight(name, (rows, cols))

    def expert_stack(self, name: str, n: int, rows: int, cols: int) -> Weight | None:
        """The (n * rows, cols) weight of a merged expert tensor; None for one tensor per expert."""
        return self._weight(name, (n, rows, cols)) if name in self.gguf.tensors else None

    def experts(self, name: str, n: int, rows: int, cols: int) -> list[Weight]:
        """The n (rows, cols) matrices of a (n, rows, cols) expert tensor (row blocks: no copy), or of
        the one tensor per expert that GGUF files from before llama.cpp merged them hold (Mixtral GGUFs of
        early 2024: blk.N.ffn_gate.E.weight for blk.N.ffn_gate_exps.weight)."""
        if name not in self.gguf.tensors:
            old = name.replace("_exps.weight", ".{}.weight")
            if old.format(0) in self.gguf.tensors:
                return [self._weight(old.format(e), (rows, cols)) for e in range(n)]
        stacked = self._weight(name, (n, rows, cols))
        return [stacked.row_block(e * rows, (e + 1) * rows) for e in range(n)]

    def vector(self, name: str, n: int) -> np.ndarray:
        return self.floats(name, (n,))

    def floats(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A small tensor (norms, biases) of `shape` as a float32 copy."""
        info = self._info(name, shape)
        try:
            return float32_of(info.array(), info.ggml_type == BF16).reshape(shape)  # small: a copy is fine
        except ModelFormatError as e:
            raise ModelFormatError(self.gguf.path, f"tensor {name!r}: {e.problem}") from e


@dataclass
class LoadedModel:
    """Everything needed to chat with one model."""

    path: Path
    model: object  # an architecture instance (forward, new_cache, cfg)
    tokenizer: Tokenizer
    template: ChatTemplate | None
    metadata: dict
    load_s: float
    file_size: int
    # the vision tower (engine.vision) when the model reads images; vision_notice says why one that the
    # model has could not be used (a broken or mismatched mmproj file), for the load's warnings
    vision: object | None = None
    vision_notice: str = ""
    # how it pools hidden states into embeddings (engine.embed.EmbeddingSpec)
    embedding: object | None = None

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or self.path.stem)

    @property
    def context_length(self) -> int:
        return int(self.model.cfg.max_position_embeddings)


def _load_hf_repo(folder: Path, t0: float) -> LoadedModel:
    cfg, weights, tokenizer, template_source, metadata, nbytes = open_hf_repo(folder)
    model = model_class(cfg.architecture)(cfg, weights)
    template = (
        ChatTemplate(template_source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
        if template_source
        else None
    )
    lm = LoadedModel(folder, model, tokenizer, template, metadata, time.perf_counter() - t0, nbytes)
    lm.embedding = embedding_spec(folder, metadata, model)
    if not getattr(model, "encoder_only", False):
        _attach_vision(lm, lambda: _hf_vision(folder, weights))
    return lm


def _hf_vision(folder: Path, weights):
    from engine.hf_repo import read_json
    from engine.vision.load import hf_vision

    return hf_vision(folder, read_json(folder / "config.json"), weights.st)


def _attach_vision(lm: LoadedModel, opener) -> None:
    """Give a model that can embed images (an `images` attribute) its vision tower, if `opener` finds one.
    A tower that cannot be used leaves the model text-only with lm.vision_notice saying why."""
    if not hasattr(lm.model, "images"):
        return
    try:
        tower = opener()
        if tower is not None:
            tower.attach(lm.model)
    except ModelFormatError as e:
        lm.vision_notice = f"images are off: {e}"
        return
    lm.vision = tower


def load_model(path: str | Path) -> LoadedModel:
    """Open a GGUF model file or a Hugging Face safetensors folder; build model, tokenizer and template.

    Raises:
        ModelNotFoundError: the path does not exist.
        ModelFormatError: the file is malformed, incomplete or uses unsupported types.
        UnsupportedArchitectureError: the architecture is not implemented.
    """
    t0 = time.perf_counter()
    path = Path(path)
    if is_hf_repo(path):
        return _load_hf_repo(path, t0)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such model file (or Hugging Face folder with a config.json)")
    gguf = open_gguf(path)
    metadata = gguf.metadata
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(path, "no general.architecture in the metadata; this is not a model file")
    cls = model_class(arch)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    weights = GGUFWeights(gguf)
    embd = gguf.tensors.get("token_embd.weight")
    vocab_size = int(embd.shape[0]) if embd is not None and len(embd.shape) == 2 else tokenizer.vocab_size
    try:
        cfg = cls.config_class.from_gguf(metadata, vocab_size=vocab_size)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelFormatError(
            path, f"incomplete or invalid {arch} hyper-parameters in the metadata ({e})"
        ) from e
    model = cls(cfg, weights)
    template = ChatTemplate.from_gguf_metadata(metadata)
    lm = LoadedModel(
        path=path,
        model=model,
        tokenizer=tokenizer,
        template=template,
        metadata=metadata,
        load_s=time.perf_counter() - t0,
        file_size=path.stat().st_size,
    )
    lm.embedding = embedding_spec(path, metadata, model)
    _attach_vision(lm, lambda: _gguf_vision(path, metadata))
    return lm


def _gguf_vision(path: Path, metadata: dict):
    """The tower in the mmproj file beside a GGUF model (whose metadata is given), None without one."""
    from engine.vision.load import find_mmproj, gguf_vision

    mmproj = find_mmproj(path)
    return gguf_vision(mmproj, metadata) if mmproj is not None else None
