"""Rows of a `.npy` file read with positioned reads: a data set larger than memory streams.

A memory map would do the reading, but every page it touches stays mapped and counts in the
process's resident memory until the kernel evicts it, so an epoch over a large shard looks like
(and, under a cgroup limit, can be charged as) holding the whole file. `os.pread` copies just the
rows asked for into a fresh array and leaves nothing mapped. Each process opens its own descriptor
on first use, so DataLoader workers (forked or spawned) never share a file offset.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


class NpyRows:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(f)
            self.offset = f.tell()
        if fortran and len(shape) > 1:
            raise ValueError(
                f"{self.path} is stored in Fortran order; save it C-ordered (np.ascontiguousarray)"
            )
        if dtype.hasobject:
            raise ValueError(f"{self.path} holds Python objects; save numeric arrays")
        self.shape: tuple[int, ...] = tuple(shape)
        self.dtype: np.dtype[Any] = dtype
        self.ndim = len(self.shape)
        self.row_shape = self.shape[1:]
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * dtype.itemsize
        self._fd: int | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_fd": None, "_pid": -1}

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as a new array."""
        stop = min(stop, len(self))
        n = max(0, stop - start)
        data = os.pread(self._descriptor(), n * self.row_bytes, self.offset + start * self.row_bytes)
        if len(data) != n * self.row_bytes:
            raise OSError(f"{self.path}: short read at row {start} (the file is truncated)")
        return np.frombuffer(bytearray(data), dtype=self.dtype).reshape((n, *self.row_shape))

    def row(self, index: int) -> np.ndarray:
        return self.rows(index, index + 1)[0]
