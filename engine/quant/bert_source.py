"""A Hugging Face BertModel folder as a conversion source, written as llama.cpp's `bert` GGUF.

What llama.cpp's converter (convert_hf_to_gguf.py, BertModel) writes, and so what its GGUFs on the Hub
hold: bert.context_length, embedding_length, feed_forward_length, block_count, attention.head_count,
attention.layer_norm_epsilon, attention.causal = false, pooling_type (from the folder's
sentence-transformers Pooling module: 1 mean, 2 cls, 3 last), tokenizer.ggml.model "bert" with
token_type_count, the vocabulary in its "phantom space" form (a word-initial piece gets U+2581 in front, a
continuation loses its "##", CONTROL tokens stay as they are), token types (added special tokens CONTROL),
and the special ids: bos = [CLS], eos = sep = [SEP], unk, pad, mask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError
from engine.quant.hf_meta import read_vocab
from engine.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL
from engine.weights import FLOAT_DTYPES, float32_of

_POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}


def _vocab_metadata(folder: Path, tok_config: dict) -> dict:
    spec, _, vocab, tokens = read_vocab(folder, "WordPiece")
    n = len(tokens)
    types = np.full(n, TOKEN_NORMAL, np.int32)
    for added in spec.get("added_tokens", []):
        if added.get("special"):
            types[added["id"]] = TOKEN_CONTROL

    def phantom(t: str, kind: int) -> str:
        if kind == TOKEN_CONTROL:
            return t
        return t[2:] if t.startswith("##") else "\u2581" + t

    def tid(key: str, default: str) -> int | None:
        v = tok_config.get(key, default)
        if isinstance(v, dict):
            v = v.get("content")
        return vocab.get(v) if isinstance(v, str) else None

    md = {
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [phantom(t, int(k)) for t, k in zip(tokens, types)],
        "tokenizer.ggml.token_type": types,
    }
    cls, sep = tid("cls_token", "[CLS]"), tid("sep_token", "[SEP]")
    for key, value in (
        ("bos_token_id", cls), ("eos_token_id", sep), ("seperator_token_id", sep),  # gguf-py's spelling
        ("unknown_token_id", tid("unk_token", "[UNK]")), ("padding_token_id", tid("pad_token", "[PAD]")),
        ("mask_token_id", tid("mask_token", "[MASK]")),
    ):
        if value is not None:
            md[f"tokenizer.ggml.{key}"] = value
    return md


def bert_source(folder: Path, config: dict):
    """The SourceModel of a BertModel folder (engine.quant.source.open_source dispatches here)."""
    from engine.arch.bert import BertConfig, hf_names
    from engine.embed import EmbeddingSpec, read_sentence_transformers
    from engine.hf_repo import read_json
    from engine.quant.source import SourceModel, _tensor_order
    from models.formats.safetensors import open_safetensors_repo

    try:
        cfg = BertConfig.from_hf(config)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(folder / "config.json", f"missing or invalid hyper-parameter ({e})") from e
    spec = EmbeddingSpec(pooling="mean", encoder_only=True)
    read_sentence_transformers(folder, spec)
    tok_path = folder / "tokenizer_config.json"
    tok_config = read_json(tok_path) if tok_path.exists() else {}
    metadata = {
        "general.architecture": "bert",
        "general.type": "model",
        "general.name": folder.name,
        "bert.context_length": cfg.max_position_embeddings,
        "bert.embedding_length": cfg.hidden_size,
        "bert.feed_forward_length": cfg.intermediate_size,
        "bert.block_count": cfg.num_hidden_layers,
        "bert.attention.head_count": cfg.num_attention_heads,
        "bert.attention.layer_norm_epsilon": np.float32(cfg.layer_norm_eps),
        "bert.attention.causal": False,
        "bert.pooling_type": _POOLING_TYPES[spec.pooling],
        "tokenizer.ggml.token_type_count": cfg.type_vocab_size,
        **_vocab_metadata(folder, tok_config),
    }
    st = open_safetensors_repo(folder)
    names = hf_names(st.tensors)
    for hf in names.values():
        if st.tensors[hf].dtype not in FLOAT_DTYPES:
            st.close()
            raise ModelFormatError(
                folder, f"tensor {hf!r} is {st.tensors[hf].dtype}; BERT conversion reads F32, F16 and BF16"
            )

    def load(name: str) -> np.ndarray:
        hf = names[name]
        return np.ascontiguousarray(float32_of(st.array(hf), st.tensors[hf].dtype == "BF16"))

    order = sorted(names, key=_tensor_order)
    return SourceModel(
        path=folder,
        kind="safetensors",
        architecture="bert",
        metadata=metadata,
        names=order,
        shapes={n: tuple(st.tensors[names[n]].shape) for n in order},
        source_types={n: FLOAT_DTYPES[st.tensors[names[n]].dtype] for n in order},
        _loader=load,
        _closer=st.close,
    )
