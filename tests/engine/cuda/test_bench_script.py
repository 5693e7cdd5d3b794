"""scripts/cuda_bench_1b.py end to end over the stand-in CuPy (test_decoder_dry): the GPU machine's one
benchmark call must not die of a Python error. Tiny shapes stand in for the 1B ones; the figures are
meaningless here, their presence is what is checked."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import numpy as np

from tests.engine.cuda import test_decoder_dry as dry

fake, ptx_params = dry.fake, dry.ptx_params  # the stand-in CuPy's fixtures

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "cuda_bench_1b.py"


def _bench_over_the_stand_in(fake, tmp_path, monkeypatch, types_arg: str):
    """The bench script at tiny shapes over the stand-in CuPy: (module, results path, argv set)."""
    spec = importlib.util.spec_from_file_location("cuda_bench_1b", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiny = dict(HIDDEN=256, FFN=512, LAYERS=2, HEADS=4, KV_HEADS=2, HEAD_DIM=64, VOCAB=4096, LONG_CTX=512)
    for name, value in tiny.items():
        monkeypatch.setattr(bench, name, value)
    normal = lambda shape, dtype: dry._wrap(np.random.default_rng(0).standard_normal(shape).astype(dtype))  # noqa: E731
    monkeypatch.setattr(fake.cp, "random", types.SimpleNamespace(standard_normal=normal), raising=False)
    monkeypatch.setattr(fake.cp, "empty_like", lambda a: dry._wrap(np.zeros_like(a)), raising=False)
    monkeypatch.setattr(fake.ops, "_sm_count", lambda: 2)
    # the bench's own spin kernel (compiled for real in the test below) and CUDA events
    spin = lambda grid, block, args: None  # noqa: E731
    monkeypatch.setattr(fake.cp, "RawKernel", lambda code, name: spin, raising=False)
    event = types.SimpleNamespace(record=lambda stream=None: None, synchronize=lambda: None)
    monkeypatch.setattr(fake.cp.cuda, "Event", lambda: event, raising=False)
    monkeypatch.setattr(fake.cp.cuda, "get_elapsed_time", lambda a, b: 1.0, raising=False)
    out = tmp_path / "results.json"
    argv = ["cuda_bench_1b", "--out", str(out), "--types", types_arg, "--prompt", "64", "--gen", "8"]
    monkeypatch.setattr("sys.argv", [*argv, "--repetitions", "1", "--workdir", str(tmp_path)])
    return bench, out


def test_bench_script_runs_every_measurement(fake, tmp_path, monkeypatch):
    bench, out = _bench_over_the_stand_in(fake, tmp_path, monkeypatch, "Q8_0,Q4_K")
    assert bench.main() == 0
    models = json.loads(out.read_text())["models"]
    for entry in models.values():
        assert not [k for k in entry if k.endswith("error")], entry
        wanted = ("decode_bandwidth_fraction", "prefill_vs_cublas", "prefill_linears_s")
        wanted += ("prefill_attention_s", "prefill_graph_tps_tile_8mib", "prefill_graph_tps_tile_32mib")
        wanted += ("prefill_first_vs_cublas", "prefill_linears_gpu_s", "prefill_attention_gpu_s")
        wanted += ("float_matvec_decode_bandwidth_fraction", "batch8_decode_tps_total")
        wanted += ("fused_decode_bandwidth_fraction", "fused_greedy_matches_graphs")
        wanted += ("fused_t256_decode_bandwidth_fraction", "fused_noprefetch_decode_bandwidth_fraction")
        wanted += ("prefill_issue_s", "prefill_gpu_s", "prefill_gpu_vs_cublas")
        wanted += ("prefill_graph_s", "prefill_graph_vs_cublas", "prefill_graph_vs_eager_rel")
        wanted += ("flash_attention_gpu_s", "flash_vs_gemm_rel", "flash_prefill_vs_cublas")
        wanted += ("flash_prefill_logits_rel", "flash_followup_logits_rel", "flash_greedy_matches")
        wanted += ("sample_topk_k40_gpu_us", "sample_topk_open_gpu_us", "sampled_decode_tps_open")
        wanted += ("pdl_vs_plain_rel", "pdl_off_decode_tps", "handoff_vs_plain_rel", "handoff_greedy_matches")
        wanted += ("handoff_decode_tps", "handoff_off_decode_tps", "batch8_pick_tps_total")
        wanted += ("long_ctx_start_splits128_decode_tps", "long_ctx_end_splits16_decode_tps")
        wanted += ("prefill_weights", "prefill_graph_tps_tile_64mib", "prefill_tiles_vs_cublas")
        for key in wanted:
            assert key in entry, key
    assert not list(tmp_path.glob("*.gguf"))  # the 1B files are deleted after their run


def test_a_failing_part_keeps_the_figures_measured_before_it(fake, tmp_path, monkeypatch):
    """The fused step's part fails (as a kernel fault would): the file's entry still holds the headline
    figures and every other part, written to the results file as each part ended."""
    bench, out = _bench_over_the_stand_in(fake, tmp_path, monkeypatch, "Q8_0")
    saved = []
    write = Path.write_text
    monkeypatch.setattr(Path, "write_text", lambda self, text: (saved.append(text), write(self, text))[1])

    def fault(*args):
        raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(bench, "_bench_fused", fault)
    assert bench.main() == 1
    entry = json.loads(out.read_text())["models"]["Q8_0"]
    assert entry["error"] == "RuntimeError: an illegal memory access was encountered"
    for key in ("decode_bandwidth_fraction", "prefill_vs_cublas", "prefill_gpu_s", "batch8_decode_tps_total"):
        assert key in entry, key
    first = json.loads(saved[0])["models"]["Q8_0"]  # the headline figures, saved before any other part
    assert "decode_bandwidth_fraction" in first and "prefill_linears_s" not in first


def test_bench_spin_kernel_assembles():
    """The bench's spin kernel (its own source, not the backend's module) through NVRTC and ptxas."""
    from engine.backends.cuda import kernels
    from tests.engine.cuda.conftest import nvrtc_or_skip

    nvrtc_or_skip()
    spec = importlib.util.spec_from_file_location("cuda_bench_1b", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert b"spin" in kernels.compile_cubin(bench.SPIN, "spin.cu", arch="sm_90")
