"""``upload_arrays``: several host arrays through one upload, each result a view of it on a 16-byte boundary."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpkv.upload import upload_arrays


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32])
def test_upload_arrays_keeps_values_shapes_and_alignment(dtype):
    arrays = [np.arange(5, dtype=dtype), np.zeros(0, dtype=dtype), (np.arange(12, dtype=dtype) * 3).reshape(3, 4),
              np.array([7], dtype=dtype)]
    got = upload_arrays(arrays, "cpu")
    assert len(got) == len(arrays)
    base = got[0].untyped_storage().data_ptr()
    for a, t in zip(arrays, got):
        assert tuple(t.shape) == a.shape and np.array_equal(t.numpy(), a)
        assert t.untyped_storage().data_ptr() == base and (t.data_ptr() - base) % 16 == 0  # one buffer, aligned


def test_upload_arrays_refuses_mixed_dtypes():
    with pytest.raises(ValueError, match="one dtype"):
        upload_arrays([np.zeros(2, np.int32), np.zeros(2, np.int64)], torch.device("cpu"))


def test_staging_refuses_a_slot_it_does_not_have():
    from cpkv.upload import staging

    for bad in (2, -1, "0"):
        with pytest.raises(ValueError, match="slot must be 0 or 1"):
            with staging("cpu", bad):
                pass


def test_stage_fills_in_place_and_sends_each_array():
    from cpkv.upload import stage

    staged = stage([3, 0, 5], np.int64, "cpu")
    assert [h.size for h in staged.host] == [3, 0, 5]
    staged.host[0][:] = [9, 8, 7]
    staged.host[2][:] = np.arange(5) * 2
    got = staged.send()
    assert [t.tolist() for t in got] == [[9, 8, 7], [], [0, 2, 4, 6, 8]]
    assert all(t.data_ptr() % 16 == 0 for t in got if t.numel())


def test_stage_refuses_a_negative_size():
    from cpkv.upload import stage

    with pytest.raises(ValueError, match=r"sizes must be >= 0, got \[3, -1\]"):
        stage([3, -1], np.int64, "cpu")


def test_stage_typed_aliases_follow_the_buffer_and_never_overlap():
    """The pinned path's bookkeeping (``_Stage.take_typed``), on an unpinned buffer: host arrays and the typed tensor
    alias the same bytes, consecutive takes do not overlap, and a buffer that grows gets fresh aliases."""
    from cpkv.upload import ALIGN, _Stage

    st = _Stage(pin=False)
    a, whole_a, at_a = st.take_typed(5, np.dtype(np.int64))
    b, whole_b, at_b = st.take_typed(3, np.dtype(np.int32))
    c, whole_c, at_c = st.take_typed(4, np.dtype(np.int64))
    assert whole_a is whole_c and whole_a.dtype == torch.int64 and whole_b.dtype == torch.int32  # kept per dtype
    a[:] = np.arange(5) + 10
    b[:] = [7, 8, 9]
    c[:] = -np.arange(4)
    assert whole_a[at_a: at_a + 5].tolist() == [10, 11, 12, 13, 14]
    assert whole_b[at_b: at_b + 3].tolist() == [7, 8, 9]
    assert whole_c[at_c: at_c + 4].tolist() == [0, -1, -2, -3]
    spans = sorted((at * w.element_size(), (at + n) * w.element_size())
                   for at, n, w in ((at_a, 5, whole_a), (at_b, 3, whole_b), (at_c, 4, whole_c)))
    assert all(s % ALIGN == 0 for s, _ in spans) and all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:]))
    assert whole_a.data_ptr() == st.buf.data_ptr()
    old = st.buf
    big, whole_big, at_big = st.take_typed(st.buf.numel(), np.dtype(np.int64))  # more than is left: a new buffer
    assert st.buf is not old and st.retired[-1] is old and at_big == 0
    assert whole_big.data_ptr() == st.buf.data_ptr() and whole_big is not whole_a
    big[:3] = [1, 2, 3]
    assert whole_big[:3].tolist() == [1, 2, 3] and whole_a[at_a: at_a + 5].tolist() == [10, 11, 12, 13, 14]
