"""numpy <-> Arrow for the hot paths, without waking pyarrow's pandas shim.

pyarrow asks its pandas shim about every array it converts from or to numpy (``pa.array``,
``to_numpy``), and the first time in a process that imports pandas where it is installed:
0.14-0.4 s of a core, which a service's first batch waited for (its row ids became an Arrow
array to take a record batch's rows, its labels became numpy). These two conversions go
through the arrays' buffers instead; what they do not cover (nulls, booleans, nested types)
falls back to pyarrow's own. Python values convert alike (:func:`from_values`: every
``pa.array`` of a list asks the shim too): ``SHOW JOBS`` in a fresh ``tabloader sql`` took
0.72 s, 0.27 of them importing pandas; :func:`empty_table` is ``schema.empty_table()``
without it. And :func:`is_binary`: which Arrow types hold binary values.

Example:
    >>> import numpy as np
    >>> ids = id_array(np.array([3, 1, 2]))
    >>> ids.to_pylist(), to_numpy(ids.slice(1)).tolist()
    ([3, 1, 2], [1, 2])
    >>> from_values(["a", None, "bc"], pa.string()).to_pylist()
    ['a', None, 'bc']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

_NUMPY = {
    pa.int8(): np.int8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint8(): np.uint8,
    pa.uint16(): np.uint16,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
    pa.float16(): np.float16,
    pa.float32(): np.float32,
    pa.float64(): np.float64,
}


def is_binary(t: pa.DataType) -> bool:
    """Whether ``t`` is one of Arrow's binary types: binary, large, fixed-size or a view."""
    return bool(
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or getattr(pa.types, "is_binary_view", lambda _: False)(t)
    )


def id_array(rows: npt.ArrayLike) -> pa.Array:
    """``rows`` (integers) as an Arrow int64 array, for ``take`` (zero-copy where they are
    int64 already)."""
    data = np.ascontiguousarray(rows, np.int64).reshape(-1)
    return pa.Array.from_buffers(pa.int64(), data.size, [None, pa.py_buffer(data)])


def to_numpy(values: pa.Array, *, copy: bool = True) -> npt.NDArray[Any]:
    """``values`` as a numpy array of its own (a copy): numbers without nulls through their
    data buffer, anything else through pyarrow. ``copy=False``: numbers without nulls as a
    read-only view of the buffer (valid while ``values`` lives)."""
    dtype = _NUMPY.get(values.type)
    if dtype is None or values.null_count:
        return np.array(values.to_numpy(zero_copy_only=False))
    data = values.buffers()[1]
    if data is None:  # an empty array
        return np.empty(0, dtype)
    size = np.dtype(dtype).itemsize
    view = np.frombuffer(data, dtype, len(values), values.offset * size)
    return view.copy() if copy else view


def from_values(values: Sequence[Any], t: pa.DataType) -> pa.Array:
    """Python ``values`` (``None`` for a null) as an Arrow array of type ``t``: int64 of
    ints, float64 of floats, booleans, strings of ``str`` and binaries of ``bytes`` through
    buffers; any other type or value through pyarrow (and its errors)."""
    present = [v for v in values if v is not None]
    kinds = {type(v) for v in present}
    n, validity = len(values), None
    if len(present) < n:
        valid = np.packbits(np.array([v is not None for v in values]), bitorder="little")
        validity = pa.py_buffer(valid.tobytes())
    if (t == pa.int64() and kinds <= {int}) or (t == pa.float64() and kinds <= {int, float}):
        data = np.array([0 if v is None else v for v in values], _NUMPY[t])
        return pa.Array.from_buffers(t, n, [validity, pa.py_buffer(data)])
    if t == pa.bool_() and kinds <= {bool}:
        bits = np.packbits(np.array([v is True for v in values]), bitorder="little")
        return pa.Array.from_buffers(t, n, [validity, pa.py_buffer(bits.tobytes())])
    text = t == pa.string() and kinds <= {str}
    if text or (t == pa.binary() and kinds <= {bytes}):
        encoded = [b"" if v is None else v.encode() if text else v for v in values]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        if offsets[-1] < 2**31:  # else pyarrow's own (an error: these offsets are 32-bit)
            buffers = [pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(encoded))]
            return pa.Array.from_buffers(t, n, [validity, *buffers])
    return pa.array(values, t)


def empty_table(schema: pa.Schema) -> pa.Table:
    """``schema.empty_table()`` (one empty chunk a column) through ``pa.nulls``, which asks no
    pandas shim."""
    return pa.table([pa.nulls(0, f.type) for f in schema], schema=schema)
