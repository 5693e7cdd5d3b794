"""Write the golden reference files in tests/goldens/ from an independent implementation.

The reference is Hugging Face `transformers` (+ `tokenizers`) running the GGUF test models in float32
on the CPU: transformers dequantizes every GGUF tensor to float32 and runs its own PyTorch model code,
so nothing here shares code with Hearth's engine. This is a DEV-ONLY tool: it runs in its own virtualenv
(see tests/goldens/README.md) and the product never imports torch or transformers.

Usage (from the repository root):
    /work/venv-golden/bin/python scripts/make_goldens.py \
        --smollm2 /work/testmodels/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--gemma3 /work/testmodels/gemma-3-270m-q4_k_m.gguf] [--out tests/goldens]

Files written per model (prefix `smollm2_` / `gemma3_`):
    *_tokens.json  a varied text corpus and its token ids (add_special_tokens=False, special tokens parsed)
    *_logits.json  per prompt and per position: top-16 ids + float32 logits, full-vocab logsumexp, max |logit|
    *_greedy.json  a prompt, its ids and the greedy continuation (32 new tokens)

Known transformers GGUF-tokenizer gaps, repaired in load_tokenizer():
(1) transformers has no entry for the GGUF pre-tokenizer "smollm" and falls back to the plain GPT-2
ByteLevel split. SmolLM2's own tokenizer.json (and llama.cpp's "smollm") first isolate every digit
(`\\p{N}`) and then apply the GPT-2 split; the two disagree when 2+ whitespace characters precede a
digit ("a  1", "x\\n\\n7"). The generator installs the faithful pre-tokenizer.
(2) For SentencePiece GGUFs (Gemma) it does not cut the user-defined space-run tokens out before BPE,
so a run of 40 spaces becomes 16+24 instead of SentencePiece's/llama.cpp's 31+9; the generator
registers them. Both tokenizers are then cross-checked against from-scratch reference encoders below.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import regex
import torch
from tokenizers import AddedToken, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
TOP_K = 16
DECIMALS = 5
GREEDY_NEW_TOKENS = 32

# GPT-2's split regex, as used by the "smollm" pre-tokenizer after the per-digit split.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    "trailing spaces   ",
    " one leading space",
    "multiple   spaces\tand\ttabs\t\there",
    "line one\nline two\r\nline three",
    "\n\n\n",
    "para one\n\n\npara two\n",
    "",
    " ",
    "Café, naïve, résumé, Zoë, São Paulo, Ærøskøbing, façade",
    "e\u0301 (decomposed), non\u00a0breaking, zero\u200bwidth",
    "日本語のテキストと中文文本。",
    "مرحبا بالعالم، كيف حالك؟",
    "Emoji: 😀🎉👍🏽🤖",
    "Family 👨\u200d👩\u200d👧\u200d👦, rainbow 🏳️\u200d🌈, flags 🇫🇷🇯🇵🇧🇷",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <stdio.h>\n\nint main(void) {\n\tfor (int i = 0; i < 10; i++) {\n\t\tprintf(\"%d\\n\", i);\n"
    "\t}\n\treturn 0;\n}\n",
    "1234567890",
    "pi is 3.14159 and e is 2.71828",
    "Numbers: 1,000,000 and -42 and 0.5e-10 on 2024-01-01",
    "Total:   42\n\n7 items\t\t9 left,  100%",
    "values = [\n    1,\n    22,\n]  # 3 spaces before digits:   7",
    "I'm sure you'll see they've gone; it's fine, we'd go, she's here",
    "I'M SURE YOU'LL SEE THEY'VE GONE",
    "Visit https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2#top or http://example.com/a_b",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <repo_name>x<file_sep>y",
    "ALL CAPS and MiXeD cAsE words",
    "Wait... what?!?! (yes) [no] {maybe} <tag> @user #hash $5 %d ^&* ~/path",
    "Mixed: English, français, Ελληνικά, русский, 한국어, हिन्दी 🤖 42!",
    "# Title\n\n- item **bold** `code`\n\n```python\nprint(1)\n```\n",
    "wide" + " " * 40 + "gap" + "\t" * 5 + "end",
]
# Texts with the model's own special tokens, appended to CORPUS for that model.
EXTRA_TEXTS = {
    "smollm2": [],
    "gemma3": ["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>text<eos> and <pad>"],
}

SMOLLM2_PLAIN_PROMPT = (
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city "
    "to the fall of Constantinople. During this time, Rome grew from a small settlement on the banks of "
    "the Tiber into a vast state that ruled the Mediterranean world and shaped the laws, roads and languages "
    "of Europe."
)
GEMMA3_PLAIN_PROMPT = SMOLLM2_PLAIN_PROMPT
GEMMA3_GREEDY_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


# ----------------------------------------------------------------------------------------------------
# small helpers


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict:
    """Versions of every library that shaped the numbers."""
    return {name: version(name) for name in ("transformers", "torch", "tokenizers", "gguf", "numpy")}


def header(model_path: Path, sha: str) -> dict:
    """Fields every golden file starts with."""
    return {
        "model": model_path.name,
        "sha256": sha,
        "generator": f"transformers {version('transformers')}",
        "versions": versions(),
        "command": "scripts/make_goldens.py (see tests/goldens/README.md)",
    }


def _dumps(obj, indent: int = 0) -> str:
    """JSON with dicts spread over lines but lists of scalars kept on one line (small, diffable files)."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        items = [f"{inner}{_dumps(v, indent + 1)}" for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def write_json(path: Path, obj: dict) -> None:
    """Write `obj` to `path` and say so."""
    path.write_text(_dumps(obj) + "\n", encoding="utf-8")
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")


def r5(x: float) -> float:
    return round(float(x), DECIMALS)


# ----------------------------------------------------------------------------------------------------
# tokenizer: load, repair, cross-check


def gguf_tokenizer_meta(model_path: Path) -> dict:
    """The tokenizer.ggml.* scalars and tables needed to check transformers' conversion."""
    from gguf import GGUFReader

    reader = GGUFReader(model_path)
    meta: dict = {}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                "tokenizer.ggml.add_eos_token", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        field = reader.fields.get(key)
        meta[key] = field.contents() if field is not None else None
    meta["tokens"] = reader.fields["tokenizer.ggml.tokens"].contents()
    meta["token_type"] = reader.fields["tokenizer.ggml.token_type"].contents()
    scores = reader.fields.get("tokenizer.ggml.scores")
    meta["scores"] = scores.contents() if scores is not None else None
    merges = reader.fields.get("tokenizer.ggml.merges")
    meta["merges"] = merges.contents() if merges is not None else None
    return meta


def load_tokenizer(model_dir: str, model_file: str, meta: dict):
    """transformers' GGUF tokenizer, with the "smollm" pre-tokenizer made faithful (see module doc)."""
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)
    notes = []
    if meta["tokenizer.ggml.pre"] == "smollm":
        current = json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"]
        if "Digits" not in json.dumps(current):
            notes.append(
                "transformers maps GGUF pre-tokenizer 'smollm' to plain ByteLevel(use_regex=True); "
                "replaced by "
                "Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)] "
                "as in SmolLM2's tokenizer.json and llama.cpp"
            )
            tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ])
    if meta["tokenizer.ggml.model"] == "llama":
        # SentencePiece and llama.cpp cut user-defined tokens (Gemma: runs of 2-31 spaces) out of the text
        # longest-first before BPE; transformers leaves the space runs to BPE merges, which splits a run of
        # 40 spaces as 16+24 instead of 31+9. Registering them as (normalized) added tokens restores that.
        present = {a.content for a in tok.added_tokens_decoder.values()}
        missing = [t.replace(" ", "\u2581") for t, kind in zip(meta["tokens"], meta["token_type"])
                   if kind == ReferenceSentencePiece.USER_DEFINED and t.replace(" ", "\u2581") not in present]
        if missing:
            vocab_size = len(tok.get_vocab())
            tok.backend_tokenizer.add_tokens([AddedToken(t, normalized=True, special=False) for t in missing])
            if len(tok.get_vocab()) != vocab_size:
                raise RuntimeError("registering user-defined tokens created new ids")
            notes.append(
                f"registered {len(missing)} GGUF user-defined tokens missing from transformers' added tokens "
                "(space runs) so they are matched longest-first before BPE, as SentencePiece and llama.cpp do"
            )
    return tok, notes


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (a published convention)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ReferenceByteBPE:
    """A from-scratch byte-level BPE for the "smollm" pre-tokenizer, used only to cross-check `tokenizers`.

    Text is cut at special tokens, each other piece is split per digit then by GPT2_SPLIT, mapped through
    the byte table and merged greedily by lowest merge rank.
    """

    def __init__(self, tokens: list[str], merges: list[str], specials: list[str]):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.b2u = byte_to_unicode()
        self.specials = sorted(specials, key=len, reverse=True)
        self.special_re = regex.compile("(" + "|".join(regex.escape(s) for s in self.specials) + ")")

    def pretokenize(self, text: str) -> list[str]:
        out = []
        for piece in regex.split(r"(\p{N})", text):
            if piece:
                out.extend(regex.findall(GPT2_SPLIT, piece))
        return out

    def bpe(self, word: str) -> list[int]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), math.inf), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [self.vocab[p] for p in parts]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in self.special_re.split(text) if self.specials else [text]:
            if chunk in self.vocab and chunk in self.specials:
                ids.append(self.vocab[chunk])
                continue
            for word in self.pretokenize(chunk):
                ids.extend(self.bpe("".join(self.b2u[b] for b in word.encode("utf-8"))))
        return ids


class ReferenceSentencePiece:
    """A from-scratch SentencePiece-BPE encoder (llama.cpp "llama" vocab) to cross-check `tokenizers`.

    Control and user-defined tokens are cut out of the raw text first (longest match, leftmost); each
    other piece has " " replaced by U+2581, is split into characters and merged greedily by the highest
    score of a normal token (leftmost on ties); characters with no token fall back to <0xXX> byte tokens.
    """

    NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

    def __init__(self, tokens: list[str], scores: list[float], types: list[int]):
        self.normal = {t: i for i, t in enumerate(tokens) if types[i] == self.NORMAL}
        self.scores = scores
        self.bytes = {t: i for i, t in enumerate(tokens) if regex.fullmatch(r"<0x[0-9A-F]{2}>", t)}
        specials = {t: i for i, t in enumerate(tokens) if types[i] in (self.CONTROL, self.USER_DEFINED) and t}
        self.specials = specials
        ordered = sorted(specials, key=len, reverse=True)
        self.special_re = regex.compile("(" + "|".join(regex.escape(t) for t in ordered) + ")")

    def bpe(self, text: str) -> list[int]:
        parts = list(text.replace(" ", "\u2581"))
        while len(parts) > 1:
            best, best_i = -math.inf, -1
            for i in range(len(parts) - 1):
                tid = self.normal.get(parts[i] + parts[i + 1])
                if tid is not None and self.scores[tid] > best:
                    best, best_i = self.scores[tid], i
            if best_i < 0:
                break
            parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        ids = []
        for p in parts:
            if p in self.normal:
                ids.append(self.normal[p])
            else:
                ids.extend(self.bytes[f"<0x{b:02X}>"] for b in p.encode("utf-8"))
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in self.special_re.split(text):
            if chunk in self.specials:
                ids.append(self.specials[chunk])
            elif chunk:
                ids.extend(self.bpe(chunk))
        return ids


def check_tokenizer(tok, meta: dict, texts: list[str], ids: list[list[int]]) -> list[str]:
    """Sanity checks of the transformers conversion; returns human-readable findings (also printed)."""
    findings = []
    vocab = tok.get_vocab()
    gguf_tokens = meta["tokens"]
    if len(vocab) != len(gguf_tokens):
        findings.append(f"vocab size {len(vocab)} != GGUF token count {len(gguf_tokens)}")
    # SentencePiece GGUFs store user-defined tokens as raw text ("  "), the HF vocab as "\u2581\u2581".
    wrong = [i for i, t in enumerate(gguf_tokens)
             if vocab.get(t) != i and vocab.get(t.replace(" ", "\u2581")) != i]
    if wrong:
        findings.append(f"{len(wrong)} GGUF tokens map to other ids, first {wrong[:5]}")
    for text, row in zip(texts, ids):
        back = tok.decode(row, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if back != text:
            findings.append(f"round trip differs: {text!r} -> {back!r}")
    if meta["tokenizer.ggml.model"] == "gpt2":
        specials = [a.content for a in tok.added_tokens_decoder.values() if a.special]
        ref = ReferenceByteBPE(gguf_tokens, meta["merges"], specials)
    elif meta["tokenizer.ggml.model"] == "llama":
        ref = ReferenceSentencePiece(gguf_tokens, meta["scores"], meta["token_type"])
    else:
        ref = None
    if ref is not None:
        for text, row in zip(texts, ids):
            mine = ref.encode(text)
            if mine != row:
                findings.append(f"reference BPE differs on {text!r}: transformers {row} vs reference {mine}")
    for f in findings:
        print("  TOKENIZER FINDING:", f)
    return findings


def write_tokens(out: Path, prefix: str, model_path: Path, sha: str, tok, meta: dict, notes: list[str],
                 unpatched) -> None:
    texts = list(CORPUS) + EXTRA_TEXTS[prefix]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    findings = check_tokenizer(tok, meta, texts, ids)
    doc = header(model_path, sha)
    doc.update({
        "tokenizer": {"ggml_model": meta["tokenizer.ggml.model"], "ggml_pre": meta["tokenizer.ggml.pre"]},
        "encode": "add_special_tokens=False; special tokens written in the text are parsed as special",
        "generator_notes": notes,
        "check_findings": findings,
    })
    if unpatched is not None:
        differs = [i for i, t in enumerate(texts) if unpatched.encode(t, add_special_tokens=False) != ids[i]]
        doc["unpatched_transformers_differs_on"] = differs
        print(f"  unpatched transformers tokenizer differs on texts {differs}")
    doc["texts"] = texts
    doc["ids"] = ids
    write_json(out / f"{prefix}_tokens.json", doc)


# ----------------------------------------------------------------------------------------------------
# model: logits and greedy decoding


def load_model(model_dir: str, model_file: str):
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=model_file, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of one uncached forward pass."""
    return model(torch.tensor([ids], dtype=torch.long), use_cache=False).logits[0].float()


def logits_record(name: str, text: str, ids: list[int], logits: torch.Tensor) -> dict:
    top = torch.topk(logits, TOP_K, dim=-1)
    lse = torch.logsumexp(logits.double(), dim=-1)
    max_abs = logits.abs().amax(dim=-1)
    return {
        "name": name,
        "text": text,
        "ids": ids,
        "top_ids": top.indices.tolist(),
        "top_logits": [[r5(v) for v in row] for row in top.values.tolist()],
        "logsumexp": [r5(v) for v in lse.tolist()],
        "max_abs_logit_per_position": [r5(v) for v in max_abs.tolist()],
        "max_abs_logit": r5(max_abs.max()),
    }


def encode_prompt(tok, text: str, add_bos: bool) -> list[int]:
    """Prompt ids as llama.cpp-style engines build them: BOS only when the GGUF asks for it."""
    ids = tok.encode(text, add_special_tokens=False)
    if add_bos and (not ids or ids[0] != tok.bos_token_id):
        ids = [tok.bos_token_id] + ids
    return ids


@torch.no_grad()
def greedy_record(model, tok, prompt_text: str, prompt_ids: list[int]) -> dict:
    """Greedy decoding two ways: `generate` (stops at EOS) and an uncached argmax loop that ignores EOS."""
    eos = tok.eos_token_id

    def decode(ids: list[int], skip_special: bool = False) -> str:
        return tok.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    out = model.generate(
        torch.tensor([prompt_ids], dtype=torch.long),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False, repetition_penalty=1.0,
        temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=eos,
    )
    new_ids = out[0, len(prompt_ids):].tolist()
    stopped_at_eos = bool(new_ids) and new_ids[-1] == eos and len(new_ids) < GREEDY_NEW_TOKENS
    # Reference loop: full recompute per step, EOS is just another token. Margin = top1 - top2 logit,
    # so a test knows which steps are near-ties that float differences could flip.
    seq, ignore_eos, margins = list(prompt_ids), [], []
    for _ in range(GREEDY_NEW_TOKENS):
        last = full_logits(model, seq)[-1]
        top2 = torch.topk(last, 2)
        nxt = int(top2.indices[0])
        ignore_eos.append(nxt)
        margins.append(r5(top2.values[0] - top2.values[1]))
        seq.append(nxt)
    if ignore_eos[:len(new_ids)] != new_ids:
        print(f"  WARNING: cached generate {new_ids} != uncached loop {ignore_eos[:len(new_ids)]}")
    return {
        "prompt_text": prompt_text,
        "prompt_ids": prompt_ids,
        "max_new_tokens": GREEDY_NEW_TOKENS,
        "settings": "do_sample=False, repetition_penalty=1.0, no top-k/top-p/temperature",
        "eos_token_id": eos,
        "new_ids": new_ids,
        "stopped_at_eos": stopped_at_eos,
        "eos_index": new_ids.index(eos) if eos in new_ids else None,
        "text": decode(new_ids),
        "text_skip_special": decode(new_ids, skip_special=True),
        "new_ids_ignore_eos": ignore_eos,
        "top1_top2_margin_ignore_eos": margins,
        "text_ignore_eos": decode(ignore_eos),
    }


# ----------------------------------------------------------------------------------------------------
# per model


def make_for_model(prefix: str, model_path: Path, out: Path) -> None:
    print(f"== {prefix}: {model_path}")
    t0 = time.time()
    sha = sha256_of(model_path)
    model_dir, model_file = str(model_path.parent), model_path.name
    meta = gguf_tokenizer_meta(model_path)
    tok, notes = load_tokenizer(model_dir, model_file, meta)
    unpatched = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file) if notes else None
    write_tokens(out, prefix, model_path, sha, tok, meta, notes, unpatched)

    model = load_model(model_dir, model_file)
    add_bos = bool(meta["tokenizer.ggml.add_bos_token"])
    prompts = []
    if tok.chat_template:
        chat_text = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
        prompts.append(("chat_capital_of_france", chat_text))
    prompts.append(("plain_text", SMOLLM2_PLAIN_PROMPT if prefix == "smollm2" else GEMMA3_PLAIN_PROMPT))
    records = []
    for name, text in prompts:
        ids = encode_prompt(tok, text, add_bos)
        records.append(logits_record(name, text, ids, full_logits(model, ids)))
        print(f"  logits {name}: {len(ids)} positions")
    doc = header(model_path, sha)
    doc.update({
        "add_bos": add_bos,
        "top_k": TOP_K,
        "decimals": DECIMALS,
        "note": "float32 logits of one uncached forward pass; log p(t) = logit(t) - logsumexp",
        "generator_notes": notes,
        "prompts": records,
    })
    write_json(out / f"{prefix}_logits.json", doc)

    if tok.chat_template:
        greedy_text = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    else:
        greedy_text = GEMMA3_GREEDY_PROMPT
    doc = header(model_path, sha)
    doc["add_bos"] = add_bos
    doc.update(greedy_record(model, tok, greedy_text, encode_prompt(tok, greedy_text, add_bos)))
    write_json(out / f"{prefix}_greedy.json", doc)
    print(f"  greedy: {doc['text']!r} (stopped_at_eos={doc['stopped_at_eos']})")
    print(f"  greedy ignoring EOS: {doc['text_ignore_eos']!r}")
    print(f"  {prefix} done in {time.time() - t0:.1f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--gemma3", type=Path, help="gemma-3-270m-q4_k_m.gguf")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "goldens")
    args = parser.parse_args(argv)
    if not args.smollm2 and not args.gemma3:
        parser.error("give at least one of --smollm2 / --gemma3")
    # Determinism: one thread, fixed seed, deterministic kernels.
    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    for prefix, path in (("smollm2", args.smollm2), ("gemma3", args.gemma3)):
        if path is None:
            continue
        if not path.is_file():
            print(f"error: {path} is not a file", file=sys.stderr)
            return 2
        make_for_model(prefix, path, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
