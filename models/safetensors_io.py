"""safetensors files read and written in row blocks, so a tensor of any size costs one block of memory.

Reading seeks to a block's bytes and reads them into a new tensor (no memory map, whose touched pages
would count as resident until the file is closed). Writing takes tensors whose names, dtypes and shapes
are known before their data exists: the header, which holds every tensor's byte range, goes first, then
each tensor's bytes as they arrive.

Format (github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}} padded with spaces
to a multiple of 8 bytes, then the tensors' little-endian bytes back to back in data_offsets order.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

# F8_E4M3: DeepSeek-V3's published weights (read only: the converter dequantizes them, models/fp8_blocks.py)
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.float8_e4m3fn: "F8_E4M3"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class SafetensorsError(ValueError):
    pass


class SafetensorsFile:
    """The tensors of one safetensors file: names, dtypes and shapes from its header; data on demand."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size_bytes = f.read(8)
            if len(size_bytes) < 8:
                raise SafetensorsError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", size_bytes)
            try:
                header = json.loads(f.read(size))
            except (json.JSONDecodeError, UnicodeDecodeError, MemoryError) as exc:
                raise SafetensorsError(f"{path} is not a safetensors file (bad header: {exc})") from exc
        self._data_start = 8 + size
        header.pop("__metadata__", None)
        self.tensors = {}
        for name, info in header.items():
            if info["dtype"] not in DTYPES:
                raise SafetensorsError(f"{path}: {name} has dtype {info['dtype']}, not one of "
                                       f"{', '.join(DTYPES)}")
            self.tensors[name] = (DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"][0])
        expected_end = self._data_start + sum(
            torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            for dtype, shape, _ in self.tensors.values())
        if path.stat().st_size < expected_end:
            raise SafetensorsError(f"{path} is truncated: {path.stat().st_size} bytes, its header needs "
                                   f"{expected_end}")

    def read_rows(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) (along dim 0) of tensor ``name``; all of it by default."""
        dtype, shape, offset = self.tensors[name]
        stop = (shape[0] if shape else 1) if stop is None else stop
        out = torch.empty((stop - start, *shape[1:]) if shape else (), dtype=dtype)
        row_bytes = torch.Size(shape[1:]).numel() * out.element_size()
        with open(self.path, "rb") as f:
            f.seek(self._data_start + offset + start * row_bytes)
            if f.readinto(out.view(torch.uint8).numpy().reshape(-1).data) != out.numel() * out.element_size():
                raise SafetensorsError(f"{self.path}: {name} ends early (truncated file)")
        return out


class SafetensorsStreamWriter:
    def __init__(self, path: Path, tensors: list[tuple[str, torch.dtype, tuple]], metadata: dict | None = None):
        header, offset = {}, 0
        for name, dtype, shape in tensors:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._planned = list(tensors)
        self._next = 0
        self._rows_written = 0  # of the tensor being written
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, name: str, rows: torch.Tensor) -> None:
        """Append the next rows (along dim 0) of the planned tensor ``name``, or all of it; tensors,
        dtypes and shapes must come in the planned order."""
        planned_name, dtype, shape = self._planned[self._next]
        rows_left = (shape[0] if shape else 1) - self._rows_written
        fits = (tuple(rows.shape) == tuple(shape) if len(shape) < 1 else
                tuple(rows.shape[1:]) == tuple(shape[1:]) and 0 < rows.shape[0] <= rows_left)
        if name != planned_name or rows.dtype != dtype or not fits:
            raise ValueError(f"safetensors stream: got {name} {rows.dtype} {tuple(rows.shape)}, planned "
                             f"{planned_name} {dtype} {tuple(shape)} with {rows_left} rows to go")
        self._file.write(rows.contiguous().view(torch.uint8).numpy().data)
        self._rows_written += rows.shape[0] if shape else 1
        if self._rows_written == (shape[0] if shape else 1):
            self._next, self._rows_written = self._next + 1, 0

    @property
    def complete(self) -> bool:
        return self._next == len(self._planned)

    def close(self) -> None:
        self._file.close()
        if not self.complete:
            raise ValueError(f"safetensors stream closed after {self._next} of {len(self._planned)} tensors")
