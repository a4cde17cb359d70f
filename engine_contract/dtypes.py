"""Bytes per element of the contract's tensor dtypes, by our names (NumPy's and
torch's spelling): standard library only, so the driver (RL side, without
protobuf) sizes routed experts by the same table the servers size weights by."""

from __future__ import annotations

TENSOR_DTYPE_BYTES = {
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
