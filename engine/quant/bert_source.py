"""A Hugging Face encoder folder (BertModel, XLMRobertaModel, nomic_bert) as a conversion source, written as
llama.cpp's `bert` or `nomic-bert` GGUF.

What llama.cpp's converter (convert_hf_to_gguf.py, BertModel) writes, and so what its GGUFs on the Hub
hold: bert.context_length, embedding_length, feed_forward_length, block_count, attention.head_count,
attention.layer_norm_epsilon, attention.causal = false, pooling_type (from the folder's
sentence-transformers Pooling module: 1 mean, 2 cls, 3 last), tokenizer.ggml.model "bert" with
token_type_count, the vocabulary in its "phantom space" form (a word-initial piece gets U+2581 in front, a
continuation loses its "##", CONTROL tokens stay as they are), token types (added special tokens CONTROL),
and the special ids: bos = [CLS], eos = sep = [SEP], unk, pad, mask. A vocabulary shorter than the
embedding's rows (nomic's 30522 tokens for 30528 rows) is padded with "[PAD<i>]" tokens of type UNUSED, as
the converter's get_vocab_base does (llama.cpp reads the vocabulary's size as the embedding's).

An XLM-RoBERTa folder (bge-m3, multilingual-e5) is a `bert` GGUF with a `t5` tokenizer (SentencePiece
unigram: _unigram_vocab_metadata), token_type_count 1 and the position embedding's first padding_idx + 1 rows
dropped (its positions count from there; context_length shrinks by as many).

nomic-bert adds rope.freq_base (rotary_emb_base) and writes context_length 2048 (what the model was trained
on; its config claims 8192); its q, k and v are one attn_qkv tensor (nomic's own Wqkv, or transformers'
q_proj|k_proj|v_proj joined), gate and up stay two (ffn_gate = fc12, ffn_up = fc11).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError, UnsupportedArchitectureError
from engine.quant.hf_meta import read_vocab
from engine.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED
from engine.weights import FLOAT_DTYPES, float32_of

_POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}



def _special_id(tok_config: dict, vocab: dict, key: str, default: str) -> int | None:
    """The id of a special token tokenizer_config.json names under `key` (a string or an AddedToken
    object), or of `default` when it names none; None when the vocabulary lacks it."""
    v = tok_config.get(key, default)
    if isinstance(v, dict):
        v = v.get("content")
    return vocab.get(v) if isinstance(v, str) else None

def _vocab_metadata(folder: Path, tok_config: dict, n_rows: int) -> dict:
    spec, _, vocab, tokens = read_vocab(folder, "WordPiece")
    types = np.full(max(len(tokens), n_rows), TOKEN_NORMAL, np.int32)
    types[len(tokens):] = TOKEN_UNUSED
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_rows)]
    for added in spec.get("added_tokens", []):
        if added.get("special"):
            types[vocab[added["content"]]] = TOKEN_CONTROL

    def phantom(t: str, kind: int) -> str:
        if kind == TOKEN_CONTROL:
            return t
        return t[2:] if t.startswith("##") else "\u2581" + t

    def tid(key: str, default: str) -> int | None:
        return _special_id(tok_config, vocab, key, default)

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


def _unigram_vocab_metadata(folder: Path, tok_config: dict, n_rows: int) -> dict:
    """An XLM-RoBERTa tokenizer.json (SentencePiece unigram) as llama.cpp's `t5` tokenizer keys
    (_xlmroberta_set_vocab): pieces, scores, types (unknown, special CONTROL, other added USER_DEFINED,
    padding "[PAD<i>]" UNUSED at -10000), the normalizer's precompiled charsmap, the space prefix,
    <s> .. </s>."""
    import base64

    spec, model, vocab, _ = read_vocab(folder, "Unigram")
    pieces = model.get("vocab") or []
    n = max(len(pieces), n_rows)
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = np.full(n, -10000.0, np.float32)
    types = np.full(n, TOKEN_UNUSED, np.int32)
    for i, (piece, score) in enumerate(pieces):
        tokens[i], scores[i], types[i] = piece, score, TOKEN_NORMAL
    for added in spec.get("added_tokens", []):
        types[vocab[added["content"]]] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
    unk = model.get("unk_id")
    if unk is not None:
        types[unk] = TOKEN_UNKNOWN
    charsmap = None
    normalizer = spec.get("normalizer") or {}
    for step in [normalizer, *normalizer.get("normalizers", [])]:
        if step.get("type") == "Precompiled" and step.get("precompiled_charsmap"):
            charsmap = np.frombuffer(base64.b64decode(step["precompiled_charsmap"]), np.uint8)
    pre = spec.get("pre_tokenizer") or {}
    prefix = any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
                 for p in [pre, *pre.get("pretokenizers", [])])

    def tid(key: str, default: str) -> int | None:
        return _special_id(tok_config, vocab, key, default)

    md = {
        "tokenizer.ggml.model": "t5",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": prefix,
        "tokenizer.ggml.remove_extra_whitespaces": True,
        **({"tokenizer.ggml.precompiled_charsmap": charsmap} if charsmap is not None else {}),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": True,
    }
    for key, value in (
        ("bos_token_id", tid("cls_token", "<s>")), ("eos_token_id", tid("sep_token", "</s>")),
        ("seperator_token_id", tid("sep_token", "</s>")), ("unknown_token_id", unk),
        ("padding_token_id", tid("pad_token", "<pad>")), ("mask_token_id", tid("mask_token", "<mask>")),
    ):
        if value is not None:
            md[f"tokenizer.ggml.{key}"] = value
    return md


def _tokenizer_type(folder: Path) -> str | None:
    try:
        spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        return (spec.get("model") or {}).get("type")
    except (OSError, ValueError):
        return None  # read_vocab says what is wrong


def bert_source(folder: Path, config: dict):
    """The SourceModel of an encoder folder, BertModel or nomic_bert (engine.quant.source.open_source
    dispatches here)."""
    from engine.embed import EmbeddingSpec, read_sentence_transformers
    from engine.hf_repo import ENCODER_TYPES, encoder_family, read_json
    from engine.quant.source import SourceModel, _tensor_order
    from models.formats.safetensors import open_safetensors_repo

    arch = ENCODER_TYPES[config["model_type"]]
    if arch == "modern-bert":
        raise UnsupportedArchitectureError(
            f"{folder}: ModernBERT models cannot be converted yet (Hearth runs their folder as it is)"
        )
    config_class, hf_names = encoder_family(arch)
    try:
        cfg = config_class.from_hf(config)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(folder / "config.json", f"missing or invalid hyper-parameter ({e})") from e
    spec = EmbeddingSpec(pooling="mean", encoder_only=True)
    read_sentence_transformers(folder, spec)
    tok_path = folder / "tokenizer_config.json"
    tok_config = read_json(tok_path) if tok_path.exists() else {}
    metadata = {
        "general.architecture": arch,
        "general.type": "model",
        "general.name": folder.name,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.layer_norm_epsilon": np.float32(cfg.layer_norm_eps),
        f"{arch}.attention.causal": False,
        f"{arch}.pooling_type": _POOLING_TYPES[spec.pooling],
        **({f"{arch}.rope.freq_base": np.float32(cfg.rope_theta)} if arch == "nomic-bert" else {}),
        "tokenizer.ggml.token_type_count": cfg.type_vocab_size,
    }
    unigram = _tokenizer_type(folder) == "Unigram"
    vocab_metadata = _unigram_vocab_metadata if unigram else _vocab_metadata
    metadata.update(vocab_metadata(folder, tok_config, cfg.vocab_size))
    st = open_safetensors_repo(folder)
    names = hf_names(st.tensors)
    for hf in names.values():
        if st.tensors[hf].dtype not in FLOAT_DTYPES:
            st.close()
            raise ModelFormatError(
                folder, f"tensor {hf!r} is {st.tensors[hf].dtype}; encoder conversion reads F32, F16 and BF16"
            )
    parts = {g: [hf] for g, hf in names.items()}
    if arch == "nomic-bert":  # transformers' q_proj, k_proj, v_proj: one attn_qkv, as llama.cpp lays it out
        for g in [g for g in parts if g.endswith(".attn_q.weight")]:
            prefix = g.removesuffix("attn_q.weight")
            parts[prefix + "attn_qkv.weight"] = [names[prefix + f"attn_{x}.weight"] for x in "qkv"]
            for x in "qkv":
                del parts[prefix + f"attn_{x}.weight"]

    def array(hf: str) -> np.ndarray:
        return float32_of(st.array(hf), st.tensors[hf].dtype == "BF16")

    # RoBERTa's unused first position rows (positions count from padding_idx + 1) dropped, as llama.cpp does
    skip = {"position_embd.weight": getattr(cfg, "position_offset", 0)}

    def load(name: str) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate([array(hf) for hf in parts[name]])[skip.get(name, 0) :])

    def shape(name: str) -> tuple[int, ...]:
        first = tuple(st.tensors[parts[name][0]].shape)
        return (first[0] * len(parts[name]) - skip.get(name, 0), *first[1:])

    order = sorted(parts, key=_tensor_order)
    return SourceModel(
        path=folder,
        kind="safetensors",
        architecture=arch,
        metadata=metadata,
        names=order,
        shapes={n: shape(n) for n in order},
        source_types={n: FLOAT_DTYPES[st.tensors[parts[n][0]].dtype] for n in order},
        _loader=load,
        _closer=st.close,
    )
