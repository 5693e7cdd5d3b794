"""Benchmark `hearth serve`: one streaming client against N concurrent ones, then a malformed-request fuzz.

Starts the real server (`python -m engine.cli serve -m MODEL --port 0`) as a child process, waits for
its ready line, and drives it over plain HTTP (SSE read line by line; the model id comes from the
official `openai` client's models.list, a dev dependency):

  1. single: one streaming chat request at a time (``--rounds`` of them), each ``--tokens`` long
     (``ignore_eos``, greedy), so every reply has the same length;
  2. concurrent: ``--clients`` streaming requests started together, one thread each, different user
     messages behind the same system prompt;
  3. fuzz: ``--fuzz`` malformed requests (engine.server.fuzz), each of which must be answered with a
     4xx carrying an OpenAI error body; then the server must still answer /health and a real request.

Prints per phase: generated tokens, wall time, aggregate tokens/s (all replies' tokens / the phase's
wall time), decode tokens/s (tokens after the first / time after the first token, summed over clients)
and median time to first token; then the ratio concurrent/single and the fuzz tally. ``--json`` prints
one JSON object instead.

  .venv/bin/python scripts/bench_serve.py [-m MODEL] [--clients 8] [--tokens 64] [--temperature T]
      [--fuzz 1000] [--json]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYSTEM = "You are a helpful assistant. Answer in full sentences."
QUESTIONS = [
    "Tell me about the sea.",
    "Describe a forest in autumn.",
    "What is a good breakfast?",
    "Explain how rain forms.",
    "Write about a city at night.",
    "Why do cats purr?",
    "Describe a mountain village.",
    "What makes a good friend?",
    "How do birds find their way?",
    "Tell me a story about a lighthouse.",
    "What is the moon made of?",
    "Describe a busy market.",
    "How does a bicycle work?",
    "Why is the sky blue?",
    "Describe a quiet library.",
    "What do bees do all day?",
]


def start_server(model: str, threads: int | None, max_seqs: int) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        "-m",
        model,
        "--port",
        "0",
        "--max-seqs",
        str(max_seqs),
    ]
    if threads:
        cmd += ["-t", str(threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "Hearth is serving" in line:
            url = line.rsplit(" at ", 1)[1].strip()
            threading.Thread(target=lambda: collections.deque(proc.stdout, 0), daemon=True).start()
            return proc, url
    proc.wait()
    raise SystemExit(f"bench_serve: the server exited with status {proc.returncode} before it was ready")


def one_stream(url: str, model: str, question: str, tokens: int, temperature: float = 0.0) -> dict:
    """One streaming chat request; times of its first and last content chunks.

    Plain http.client with a line-by-line SSE read, not the openai client: its per-chunk objects cost
    the client more CPU than the server spends on the token, and here both share the same cores.
    """
    where = urllib.parse.urlsplit(url)
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    first = last = None
    usage = None
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"bench_serve: HTTP {r.status}: {r.read()[:300]!r}")
        for line in r:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                usage = chunk["usage"]
    finally:
        conn.close()
    return {"start": t0, "first": first, "last": last, "tokens": usage["completion_tokens"]}


def phase(url: str, model: str, questions: list[str], tokens: int, temperature: float = 0.0) -> dict:
    results: list[dict] = [{}] * len(questions)

    def run(i: int) -> None:
        results[i] = one_stream(url, model, questions[i], tokens, temperature)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any(not r for r in results):
        raise SystemExit("bench_serve: a client failed (see its traceback above)")
    total = sum(r["tokens"] for r in results)
    decode_span = max(r["last"] for r in results) - min(r["first"] for r in results)
    decode_tokens = sum(r["tokens"] - 1 for r in results)
    return {
        "clients": len(questions),
        "tokens": total,
        "wall_s": wall,
        "aggregate_tps": total / wall,
        "decode_tps": decode_tokens / decode_span if decode_span > 0 else float("nan"),
        "ttft_median_s": statistics.median(r["first"] - r["start"] for r in results),
    }


def fuzz(port: int, model: str, n: int) -> dict:
    from engine.server.fuzz import cases, check, send

    statuses: collections.Counter = collections.Counter()
    wrong: list[str] = []
    t0 = time.perf_counter()
    for case in cases(n, model, seed=1234, port=port):
        try:
            status, body = send(case, port)
        except OSError as e:
            wrong.append(f"{case.method} {case.path}: no answer ({e})")
            continue
        statuses[status] += 1
        why = check(status, body)
        if why:
            wrong.append(f"{case.method} {case.path}: {why}")
    return {
        "requests": n,
        "wall_s": time.perf_counter() - t0,
        "statuses": dict(sorted(statuses.items())),
        "not_4xx_or_bad_body": len(wrong),
        "examples": wrong[:5],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct", help="model path or starter name")
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per reply (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="single-client requests; the best counts")
    ap.add_argument("--fuzz", type=int, default=1000, help="malformed requests (default 1000; 0: none)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="server CPU threads")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0 samples")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    temp = args.temperature

    import openai

    proc, url = start_server(args.model, args.threads, max(args.clients, 1))
    try:
        port = urllib.parse.urlsplit(url).port
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        phase(url, model, QUESTIONS[:2], 8, temp)  # warm-up: prefix store, kernels, batch shapes
        singles = [
            phase(url, model, [QUESTIONS[i % len(QUESTIONS)]], args.tokens, temp) for i in range(args.rounds)
        ]
        single = max(singles, key=lambda r: r["aggregate_tps"])
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.clients)]
        many = phase(url, model, questions, args.tokens, temp)
        out = {
            "model": model,
            "tokens_per_reply": args.tokens,
            "temperature": temp,
            "single": single,
            "concurrent": many,
            "aggregate_speedup": many["aggregate_tps"] / single["aggregate_tps"],
            "decode_speedup": many["decode_tps"] / single["decode_tps"],
        }
        if args.fuzz:
            out["fuzz"] = fuzz(port, model, args.fuzz)
            with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/health", timeout=30) as r:
                healthy = r.status == 200
            after = one_stream(url, model, QUESTIONS[0], 4)
            out["fuzz"]["alive_after"] = healthy and proc.poll() is None and after["tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(30)

    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    how = "greedy" if temp == 0 else f"temperature {temp:g}, top-k off"
    print(f"model {model}, {args.tokens} tokens per reply ({how}, ignore_eos)")
    for name in ("single", "concurrent"):
        r = out[name]
        print(
            f"  {name:10s} {r['clients']:2d} client(s): {r['tokens']:4d} tokens in {r['wall_s']:6.2f} s, "
            f"aggregate {r['aggregate_tps']:6.1f} tok/s, decode {r['decode_tps']:6.1f} tok/s, "
            f"TTFT median {r['ttft_median_s'] * 1000:5.0f} ms"
        )
    print(
        f"  concurrent / single: aggregate {out['aggregate_speedup']:.2f}x, "
        f"decode {out['decode_speedup']:.2f}x"
    )
    if "fuzz" in out:
        f = out["fuzz"]
        print(
            f"  fuzz: {f['requests']} malformed requests in {f['wall_s']:.1f} s, statuses {f['statuses']}, "
            f"{f['not_4xx_or_bad_body']} not a 4xx with an error body, server alive after: {f['alive_after']}"
        )
        for e in f["examples"]:
            print(f"    {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
