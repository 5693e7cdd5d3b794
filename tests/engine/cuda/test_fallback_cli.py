"""`--device` on hearth run / bench: a CUDA request without a usable GPU runs on the CPU and says so."""

from __future__ import annotations

import json

import pytest

from engine.backends.cuda import device as dev
from engine.cli import main
from tests.engine.tiny_models import TinySpec, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda-fallback") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec())
    return path


def _no_gpu(monkeypatch):
    def missing():
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(dev, "_import_cupy", missing)


def _run(path, *extra):
    return ["run", "-m", str(path), "--temperature", "0", "-n", "4", "--json", *extra, "ab"]


def test_run_falls_back_with_a_notice(monkeypatch, capsys, tiny_path):
    assert main(_run(tiny_path)) == 0
    on_cpu = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    _no_gpu(monkeypatch)
    assert main(_run(tiny_path, "--device", "cuda")) == 0
    captured = capsys.readouterr()
    assert "hearth: CUDA unavailable: CuPy is not installed" in captured.err
    assert "running on the CPU" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["ids"] == on_cpu["ids"]


def test_bench_falls_back_with_zero_gpus(monkeypatch, capsys, tiny_path):
    monkeypatch.setattr(dev, "_import_cupy", lambda: _FakeCupy)
    argv = [
        "bench",
        "-m",
        str(tiny_path),
        "-p",
        "8",
        "-g",
        "4",
        "--ctx",
        "64",
        "--json",
        "--device",
        "cuda:0",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "CUDA unavailable: no CUDA GPU found" in captured.err
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["decode_tps"] > 0 and out["device"] == "cpu"  # the CPU bench's figures


def test_cpu_device_never_probes(monkeypatch, capsys, tiny_path):
    monkeypatch.setattr(dev, "_import_cupy", lambda: pytest.fail("--device cpu must not import cupy"))
    assert main(_run(tiny_path, "--device", "cpu")) == 0
    assert "CUDA" not in capsys.readouterr().err


def test_bad_device_is_a_clear_error(capsys, tiny_path):
    assert main(_run(tiny_path, "--device", "gpu")) == 1
    assert "unknown device 'gpu': use cpu, cuda or cuda:N" in capsys.readouterr().err


def test_serve_refuses_bad_device_options_before_loading(capsys, tiny_path):
    assert main(["serve", "-m", str(tiny_path), "--port", "0", "--device", "gpu"]) == 1
    assert "unknown device 'gpu'" in capsys.readouterr().err
    assert main(["serve", "-m", str(tiny_path), "--port", "0", "--device", "cuda", "-ngl", "-3"]) == 1
    assert "--gpu-layers must be at least 0" in capsys.readouterr().err


class _FakeCupy:
    class cuda:  # noqa: N801 - mirrors cupy.cuda.runtime
        class runtime:  # noqa: N801
            @staticmethod
            def getDeviceCount():  # noqa: N802
                return 0
