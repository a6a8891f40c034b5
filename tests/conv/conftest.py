"""Fixtures shared by the convolution tests."""
import pytest

from nnprim.conv import cpu_wino_native as native


@pytest.fixture(params=["native", "torch_ops"])
def winograd_transforms(request, monkeypatch):
    """A test on both CPU Winograd transform paths: the native one (cpu_wino_native) and torch ops."""
    if request.param == "torch_ops":
        monkeypatch.setattr(native, "ops", lambda: None)
    elif native.ops() is None:
        pytest.skip("no C++ compiler: the native transforms are not built")
    return request.param
