"""ops.outputs.hand_back on the CPU: a caller of the allocating framework gets the array itself (no
stream switch); any other caller goes through the export on the launch stream."""

from gqadrv.ops import outputs


class Arr:
    pass


class Other:
    pass


def test_hand_back_same_type_needs_no_stream_switch(monkeypatch):
    def boom(*a):
        raise AssertionError("on_stream must not be entered")

    monkeypatch.setattr(outputs, "on_stream", boom)
    a = Arr()
    assert outputs.hand_back(outputs.NewOutput(1, None, a), Arr(), 7, 0) is a


def test_hand_back_other_framework_exports_on_the_stream(monkeypatch):
    entered = []

    class Ctx:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(outputs, "on_stream", lambda s, d: Ctx())
    monkeypatch.setattr(outputs._tensors, "export_like", lambda arr, like: ("exported", arr, like))
    a, like = Arr(), Other()
    assert outputs.hand_back(outputs.NewOutput(1, None, a), like, 7, 0) == ("exported", a, like)
    assert entered == [True]


def test_hand_back_torch_allocation_returns_the_tensor():
    t = object()
    assert outputs.hand_back(outputs.NewOutput(1, t, None), Other(), 7, 0) is t
