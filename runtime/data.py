"""Byte-level training data: every plan sees exactly the same global batch at every step.

Tokens are bytes (ids 0..255), so any model with ``vocab_size >= 256`` can train on any file;
nothing is downloaded. The default corpus is the source of the Python standard library.

Sample ``i`` of epoch ``e`` is the window of ``seq_len + 1`` bytes that starts at
``perm_e[i] * seq_len``, where ``perm_e`` is a permutation of the window starts seeded with
``seed + e``. Step ``k``'s global batch is samples ``[k·B, (k+1)·B)``; data-parallel rank ``r`` of
``dp`` takes the contiguous slice ``[r·B/dp, (r+1)·B/dp)`` of it. So a single-process run and any
DP × TP × PP run of the same seed train on the same tokens in the same order, and a resumed run can
continue from the exact sample offset ``k·B``.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

#: Bytes of the default corpus kept (enough for thousands of steps; reading more costs time).
DEFAULT_CORPUS_BYTES = 8_000_000

#: Folders of the stdlib tree that are not the standard library's own source.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def default_corpus_bytes(max_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """The bytes of the standard library's ``.py`` files, in sorted path order, capped.

    The files are found through ``sysconfig.get_paths()["stdlib"]``; third-party packages
    (site-packages) are skipped.

    Args:
        max_bytes: stop after the file that brings the total past this many bytes.
    Returns:
        At most ``max_bytes`` bytes.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        paths.extend(Path(folder, f) for f in files if f.endswith(".py"))
    chunks, total = [], 0
    for path in sorted(paths):
        chunk = path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def read_corpus(path: str | os.PathLike | None, seq_len: int) -> torch.Tensor:
    """The training tokens: the bytes of ``path``, or the default corpus when ``path`` is None.

    Returns:
        (N,) uint8 tensor of byte ids, N >= seq_len + 1.
    Raises:
        FileNotFoundError: ``path`` does not exist (the message names it).
        ValueError: the data is shorter than one sequence of ``seq_len + 1`` bytes.
    """
    if path is None:
        data, name = default_corpus_bytes(), "the standard-library corpus"
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"--data file {str(file)!r} does not exist")
        data, name = file.read_bytes(), f"--data file {str(file)!r}"
    if len(data) < seq_len + 1:
        raise ValueError(f"{name} has {len(data)} bytes, fewer than one sequence needs "
                         f"(seq_len + 1 = {seq_len + 1})")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteBatches:
    """Deterministic global batches of byte windows (see the module docstring).

    Args:
        tokens: (N,) uint8 byte ids (from `read_corpus`).
        seq_len: tokens per sequence (T).
        global_batch: sequences per step, all data-parallel ranks together (B).
        seed: seeds the window order; epoch ``e`` uses ``seed + e``.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, global_batch: int,
                 seed: int = 0) -> None:
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"{tokens.numel()} tokens are fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.num_windows = (tokens.numel() - 1) // seq_len   # window j starts at j·T
        self._perms: dict[int, torch.Tensor] = {}

    def _start(self, sample: int) -> int:
        """First byte of global sample ``sample``."""
        epoch, i = divmod(sample, self.num_windows)
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(self.num_windows, generator=g)}
        return int(self._perms[epoch][i]) * self.seq_len

    def samples(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``[first, first + count)`` as (inputs, targets), each (count, T) int64."""
        t = self.seq_len
        rows = [self.tokens[s:s + t + 1] for s in map(self._start, range(first, first + count))]
        window = torch.stack(rows).long()                    # (count, T + 1)
        return window[:, :-1], window[:, 1:]                 # (count, T), (count, T)

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s (0-based) global batch: (inputs, targets), each (B, T) int64."""
        return self.samples(step * self.global_batch, self.global_batch)

    def local_batch_at(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Data-parallel rank ``dp_rank``'s contiguous slice of step ``step``'s global batch.

        Returns:
            (inputs, targets), each (B/dp, T) int64.
        Raises:
            ValueError: ``dp`` does not divide the global batch.
        """
        if self.global_batch % dp:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by dp={dp}")
        local = self.global_batch // dp
        return self.samples(step * self.global_batch + dp_rank * local, local)

    def local_sample_ids(self, step: int, dp_rank: int, dp: int) -> list[int]:
        """Global sample indices of `local_batch_at` (``step`` 0-based): the ids a run records
        per DP rank so that a resumed run can be checked to skip and repeat nothing."""
        local = self.global_batch // dp
        first = step * self.global_batch + dp_rank * local
        return list(range(first, first + local))
