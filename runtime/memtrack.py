"""Peak bytes of tensor storage allocated inside a region, on any device (the CPU included).

``torch.cpu`` keeps no memory statistics, and RSS is noisy (allocator caching, mmap
thresholds), so `PeakTensorBytes` counts storages instead: a ``TorchDispatchMode`` sees every
tensor an op returns, remembers its storage by a weak reference, and after each op sums the
storages still alive. Tensors that existed before the region (inputs, parameters) are not
counted. The sweep is O(live storages) per op: for tests and benchmarks, not for training.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensorBytes(TorchDispatchMode):
    """``with PeakTensorBytes() as m: ...``; then ``m.peak_bytes`` (int, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self._live.setdefault(storage.data_ptr(), (StorageWeakRef(storage),
                                                           storage.nbytes()))
        self._live = {ptr: ref for ptr, ref in self._live.items() if not ref[0].expired()}
        self.peak_bytes = max(self.peak_bytes, sum(size for _, size in self._live.values()))
        return out
