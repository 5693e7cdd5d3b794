"""Device selection and the CPU fallback, without a GPU: CuPy missing or zero devices simulated."""

from __future__ import annotations

import types

import pytest

from engine.backends.cuda import device as dev


def _fake_cupy(count=None, error=None, nvrtc_error=None):
    def get_count():
        if error is not None:
            raise error
        return count

    def nvrtc_version():
        if nvrtc_error is not None:
            raise nvrtc_error
        return (12, 9)

    return types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=get_count),
            nvrtc=types.SimpleNamespace(getVersion=nvrtc_version),
        )
    )


def test_parse_device():
    assert dev.parse_device(None) == dev.Device("cpu")
    assert dev.parse_device("CPU") == dev.Device("cpu")
    assert dev.parse_device("cuda") == dev.Device("cuda", 0)
    assert str(dev.parse_device("cuda:3")) == "cuda:3"
    for bad in ("gpu", "cuda:", "cuda:x", "cuda:-1"):
        with pytest.raises(dev.DeviceSpecError, match="cpu, cuda or cuda:N"):
            dev.parse_device(bad)


def test_cpu_needs_no_probe(monkeypatch):
    monkeypatch.setattr(dev, "_import_cupy", lambda: pytest.fail("cpu must not import cupy"))
    assert dev.choose_device("cpu") == dev.DeviceChoice(dev.Device("cpu"), None)


def test_fallback_without_cupy(monkeypatch):
    def missing():
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(dev, "_import_cupy", missing)
    choice = dev.choose_device("cuda")
    assert choice.device == dev.Device("cpu")
    assert "CuPy is not installed" in choice.notice and "running on the CPU" in choice.notice


def test_fallback_with_zero_devices(monkeypatch):
    monkeypatch.setattr(dev, "_import_cupy", lambda: _fake_cupy(count=0))
    choice = dev.choose_device("cuda:0")
    assert choice.device.kind == "cpu" and "no CUDA GPU found" in choice.notice


def test_fallback_when_the_driver_raises(monkeypatch):
    monkeypatch.setattr(dev, "_import_cupy", lambda: _fake_cupy(error=RuntimeError("cudaErrorNoDevice")))
    choice = dev.choose_device("cuda")
    assert choice.device.kind == "cpu" and "cudaErrorNoDevice" in choice.notice


def test_index_out_of_range_and_a_usable_gpu(monkeypatch):
    monkeypatch.setattr(dev, "_import_cupy", lambda: _fake_cupy(count=2))
    assert dev.choose_device("cuda:1") == dev.DeviceChoice(dev.Device("cuda", 1), None)
    choice = dev.choose_device("cuda:2")
    assert choice.device.kind == "cpu" and "GPU 2 does not exist (2 CUDA devices found)" in choice.notice


def test_fallback_without_nvrtc(monkeypatch):
    missing = OSError("libnvrtc.so.12: cannot open shared object file")
    monkeypatch.setattr(dev, "_import_cupy", lambda: _fake_cupy(count=1, nvrtc_error=missing))
    choice = dev.choose_device("cuda")
    assert choice.device.kind == "cpu" and "pip install nvidia-cuda-nvrtc-cu12" in choice.notice


def test_out_of_memory_error_says_what_to_do():
    e = dev.CudaOutOfMemoryError(3 * 2**30, 2**30, 0)
    assert "3.00 GiB" in str(e) and "--device cpu" in str(e) and "--gpu-layers" not in str(e)
    e = dev.CudaOutOfMemoryError(3 * 2**30, 2**30, 0, layers_fit=9, n_layers=28)
    assert "offload only 9 of the 28 layers (--gpu-layers 9)" in str(e)
