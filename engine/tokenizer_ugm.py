"""SentencePiece unigram tokenizers (llama.cpp's `t5` tokenizer model: XLM-RoBERTa encoders such as bge-m3 and
multilingual-e5, T5) rebuilt from a GGUF vocabulary as a Hugging Face `tokenizers.Tokenizer`.

What the GGUF holds (convert_hf_to_gguf.py `_xlmroberta_set_vocab`): the pieces (U+2581 for a space), their
log-probability scores and types, `tokenizer.ggml.precompiled_charsmap` (SentencePiece's normalization table,
NFKC and friends, as tokenizer.json's Precompiled normalizer holds it), `add_space_prefix` (a U+2581 before
the text) and `remove_extra_whitespaces` (runs of spaces collapsed, the ends trimmed). The rebuilt tokenizer
is the one transformers writes for XLM-RoBERTa: the charsmap, whitespace splitting, Metaspace, then the
unigram model's best segmentation (Viterbi over the scores), pieces it cannot spell as the unknown token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED, TokenizerError


def unigram_tokenizer(
    metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int], unk_id: int | None
) -> HFTokenizer:
    """The Hugging Face unigram tokenizer of a `t5` GGUF vocabulary.

    Raises:
        TokenizerError: scores missing or not one per token.
    """
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TokenizerError("tokenizer.ggml.scores is missing or not one per token ('t5' needs them)")
    if unk_id is None:
        unk_id = next((i for i, k in enumerate(types) if k == TOKEN_UNKNOWN), None)
    scores = np.asarray(scores, dtype=np.float64).tolist()
    vocab = [(t, s) for t, s in zip(tokens, scores)]
    hf = HFTokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=False))
    steps = []
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None and len(charsmap):
        steps.append(normalizers.Precompiled(bytes(np.asarray(charsmap, dtype=np.uint8))))
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", True):
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    if steps:
        hf.normalizer = normalizers.Sequence(steps)
    scheme = "always" if metadata.get("tokenizer.ggml.add_space_prefix", True) else "never"
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])
    hf.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    hf.add_special_tokens(
        [
            AddedToken(tokens[i], special=k != TOKEN_USER_DEFINED, normalized=False)
            for i, k in enumerate(types)
            if k in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)
        ]
    )
    return hf
