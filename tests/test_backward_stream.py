"""backward_api's workspace stream: the raw launch handle becomes a CuPy stream without CuPy's
ExternalStream deprecation warning (no GPU needed: wrapping a handle touches no device)."""
import warnings

import pytest

cupy = pytest.importorskip("cupy")

from cupyflash.interop import external_stream as _external_stream  # noqa: E402


@pytest.mark.parametrize("handle", [0, 0x7F00_1234_5000])
def test_external_stream_wraps_the_handle_without_deprecation(handle):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream = _external_stream(handle, 0)
    assert stream.ptr == handle
