"""The engine worker's chat runner on a CUDA device (LoadOptions.device / gpu_layers).

Without a GPU: the fallback to the CPU with its notice, and (over test_decoder_dry's stand-in
CuPy with the kernels on host threads) a chat turn on a partially offloaded model that replies
exactly what the CPU runner replies.
"""
# ruff: noqa: F811 - the stand-in CuPy fixtures are imported from test_decoder_dry

from __future__ import annotations

import numpy as np
import pytest

from engine.client import LoadOptions
from engine.generate import GenerationParams
from tests.engine.cuda.test_decoder_dry import FULL_SIMT, STATE, fake, ptx_params, simt  # noqa: F401 - fixtures
from tests.engine.tiny_models import T, TinySpec, write_tiny_gguf

GREEDY = GenerationParams(max_tokens=3, temperature=0.0)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def tiny_path(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, layers=2))
    return path


def _load(path, **kw):
    from engine.worker import ChatRunner

    steps = []
    options = LoadOptions(n_ctx=128, batch_size=64, prefix_cache_mb=1, **kw)
    return ChatRunner.load(path, options, progress=steps.append), steps


def _reply(runner) -> tuple[str, list[int]]:
    events = list(runner.chat(MESSAGES, GREEDY))
    return "".join(e.text for e in events), [e.token for e in events if e.token is not None]


def test_bad_device_options_are_refused():
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        LoadOptions(device="gpu")
    with pytest.raises(ValueError, match="gpu_layers"):
        LoadOptions(device="cuda", gpu_layers=-2)


def test_cuda_request_without_a_gpu_runs_on_the_cpu_and_says_why(tiny_path, monkeypatch):
    from engine.backends.cuda import device

    monkeypatch.setattr(device, "probe", lambda index=0: "no CUDA GPU found")
    runner, steps = _load(tiny_path, device="cuda")
    warnings = [s.message for s in steps if s.stage == "warning"]
    assert "CUDA unavailable: no CUDA GPU found; running on the CPU" in warnings
    assert runner.info.device == "cpu"
    assert _reply(runner)[1]


# The full offload launches the output matvec over a grid sized for a real GPU: ~40 s on host threads.
@pytest.mark.parametrize(
    "layers, gpu_layers, placement",
    [
        (2, 1, "cuda:0 (1/2 layers)"),
        pytest.param(1, None, "cuda:0", marks=pytest.mark.skipif(not FULL_SIMT, reason="HEARTH_CUDA_SIMT=1")),
    ],
)
def test_chat_on_the_gpu_replies_as_the_cpu(fake, simt, tmp_path, layers, gpu_layers, placement):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, layers=layers))
    cpu_runner, _ = _load(path)
    want = _reply(cpu_runner)
    STATE.simt = simt
    runner, steps = _load(path, device="cuda", gpu_layers=gpu_layers)
    assert runner.info.device == placement
    uploads = [s.fraction for s in steps if s.stage == "upload"]
    assert uploads and uploads == sorted(uploads) and uploads[-1] == pytest.approx(0.8)
    assert runner.cache.dtype == np.float16  # the KV precision setting (default f16) holds on the GPU too
    assert _reply(runner) == want
    assert _reply(runner) == want  # the next turn reuses the live cache
