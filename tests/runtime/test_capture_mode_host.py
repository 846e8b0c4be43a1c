"""``streams.relaxed_capture_mode`` on the CPU with a fake driver: the thread's capture-interaction
mode is relaxed inside the block and the previous mode restored after it, also when the block
raises; a failing driver call raises CudaDriverError."""

from __future__ import annotations

import pytest

from gqadrv.runtime import driver, streams


class FakeDriver:
    class CUstreamCaptureMode:
        CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, CU_STREAM_CAPTURE_MODE_RELAXED = 0, 1, 2

    def __init__(self, fail=False):
        self.mode, self.calls, self.fail = 0, [], fail

    def cuThreadExchangeStreamCaptureMode(self, mode):
        self.calls.append(mode)
        if self.fail:
            return (1,)
        prev, self.mode = self.mode, mode
        return (0, prev)

    def cuGetErrorName(self, err):
        return (0, b"CUDA_ERROR_INVALID_VALUE")

    def cuGetErrorString(self, err):
        return (0, b"invalid argument")


@pytest.fixture
def fake(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(driver, "driver", lambda: d)
    return d


def test_relaxed_inside_and_restored_after(fake):
    fake.mode = 1
    with streams.relaxed_capture_mode():
        assert fake.mode == 2
    assert fake.mode == 1 and fake.calls == [2, 1]


def test_restored_when_the_block_raises(fake):
    with pytest.raises(KeyError):
        with streams.relaxed_capture_mode():
            raise KeyError("x")
    assert fake.mode == 0 and fake.calls == [2, 0]


def test_nested_blocks_restore_in_order(fake):
    with streams.relaxed_capture_mode():
        with streams.relaxed_capture_mode():
            assert fake.mode == 2
        assert fake.mode == 2
    assert fake.mode == 0


def test_a_failing_driver_call_raises(monkeypatch):
    d = FakeDriver(fail=True)
    monkeypatch.setattr(driver, "driver", lambda: d)
    with pytest.raises(driver.CudaDriverError, match="cuThreadExchangeStreamCaptureMode"):
        with streams.relaxed_capture_mode():
            pass
