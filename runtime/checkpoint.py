"""Asynchronous, atomic, verified training checkpoints with `torch.distributed.checkpoint`.

Layout of a checkpoint folder::

    DIR/step00000006/.metadata, __0_0.distcp, __1_0.distcp   DCP: model + optimizer, sharded
    DIR/step00000006/extra_rank{r}.pt                          rank r: RNG states, data position
                                                               (and the job's world size, mesh)
    DIR/step00000006/manifest.json                             sha256 and size of every file
    DIR/latest                                                 name of the newest checkpoint

A save writes into ``DIR/tmp-step...`` and rank 0 renames it to ``DIR/step...`` only after every
rank's shard and the manifest are on disk (``os.rename`` of a folder is atomic on POSIX), so a
crash mid-write never leaves a folder that looks complete. The newest ``keep`` are kept.
`CheckpointManager.load_latest` verifies the manifest's checksums and falls back to the previous
checkpoint when the newest one is damaged. DCP reshards model and optimizer state when the
resuming job has another DP / TP / PP layout; the per-rank ``extra`` files are then replaced by
job-wide fields (`load_extra`, `runtime.resilience.Resilience.resume`).

``dcp.async_save`` returns after planning the save; a background thread copies the state
(staging, with reused buffers) and another writes the shards while training continues. The copy
must be complete before the next optimizer step changes the parameters in place:
`CheckpointManager.wait_staged` is called between backward and the optimizer step, so the copy
hides under the next forward and backward. The save runs on its own gloo process group: on the
default group, the save's collectives interleave with training's and gloo aborts ("Received
data size doesn't match expected size"; measured on torch 2.13).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from runtime.faults import corrupt_file

#: Seconds a rank waits for rank 0 to finish (rename) a checkpoint it helped write.
LAND_TIMEOUT_S = 60.0
MANIFEST = "manifest.json"
#: Optimizer state keyed by parameter FQN, param-group settings included
#: (``param_groups.<fqn>.lr``): pipeline stages hold different parameters, and the default
#: list form (``param_groups.0.lr``) gives every stage the same keys, so one stage's groups
#: would overwrite the other's in the checkpoint (a resume then fails in AdamW.step with
#: ``KeyError: 'betas'``). Keyed by FQN, any layout can load any other's (DCP resharding).
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after ``step`` (sorts by step)."""
    return f"step{step:08d}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, step: int) -> dict:
    """Write ``folder/manifest.json`` (sha256 + size of every other file) and return it."""
    files = {p.name: {"sha256": sha256_file(p), "size_bytes": p.stat().st_size}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"step": step, "files": files, "time_unix_s": time.time()}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)
    return manifest


def verify(folder: Path) -> str | None:
    """None when every file matches the manifest, else what is wrong (one line)."""
    path = folder / MANIFEST
    if not path.is_file():
        return f"{folder.name} has no {MANIFEST}"
    for name, entry in json.loads(path.read_text())["files"].items():
        file = folder / name
        if not file.is_file():
            return f"{folder.name}/{name} is missing"
        if file.stat().st_size != entry["size_bytes"]:
            return f"{folder.name}/{name} has {file.stat().st_size} bytes, manifest says " \
                   f"{entry['size_bytes']}"
        if sha256_file(file) != entry["sha256"]:
            return f"{folder.name}/{name} fails its sha256 check"
    return None


def list_checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoints in ``folder``, newest first (temporary folders excluded)."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step")),
                  reverse=True)


def _container(modules: list[torch.nn.Module]) -> torch.nn.Module:
    return modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)


#: A chunk index that a ModuleList of pipeline chunks puts in front of each FQN, in model keys
#: (``0.tok.weight``) and flattened optimizer keys (``state.0.tok.weight.exp_avg``,
#: ``param_groups.0.tok.weight.lr``).
_CHUNK_PREFIX = re.compile(r"^((?:state|param_groups)\.)?\d+\.")


def chunk_free_key(key: str) -> str:
    """``key`` of a rank that holds several pipeline chunks (interleaved virtual stages)
    without the chunk's position in that rank's list, so that a parameter has the same key
    on every layout: chunks keep the model's own FQNs (layer keys keep their global numbers,
    `runtime.parallel.pp.split_for_stage`), and only the container adds the index.

    >>> chunk_free_key("0.layers.3.attn.qkv.weight"), chunk_free_key("state.1.out.weight.step")
    ('layers.3.attn.qkv.weight', 'state.out.weight.step')
    >>> chunk_free_key("param_groups.0.tok.weight.lr")
    'param_groups.tok.weight.lr'
    """
    return _CHUNK_PREFIX.sub(lambda m: m.group(1) or "", key, count=1)


def _rekey(state: dict, rename) -> dict:
    """``state`` with its keys renamed (an error when two keys would become one)."""
    out = {rename(k): v for k, v in state.items()}
    if len(out) != len(state):
        raise RuntimeError("pipeline chunks of one rank share a parameter name; their "
                           "checkpoint keys would collide")
    return out


class CheckpointManager:
    """Saves and loads this rank's part of the training state (see the module docstring).

    Args:
        folder: the checkpoint folder (shared by all ranks).
        modules: this rank's parallel modules (`runtime.train.build_step`).
        optimizer: the optimizer over their parameters.
        keep: newest checkpoints kept (>= 1).
        asynchronous: ``dcp.async_save`` (default) or a blocking ``dcp.save``.
        corrupt_at: ``step -> bool``; rank 0 damages that step's checkpoint after writing it
            (`runtime.faults.Injector.corrupt_at`).
        timeout_s: collective timeout of the checkpoint's process group.
    """

    def __init__(self, folder: str | os.PathLike, modules: list[torch.nn.Module],
                 optimizer: torch.optim.Optimizer, *, keep: int = 2, asynchronous: bool = True,
                 corrupt_at=None, timeout_s: float = 120.0) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1")
        self.folder = Path(folder)
        self.model = _container(modules)
        self.optimizer = optimizer
        self.keep = keep
        self.asynchronous = asynchronous
        self.corrupt_at = corrupt_at or (lambda step: False)
        self.rank = dist.get_rank()
        # async_save's collectives must not share the training group (module docstring)
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._future: Future | None = None
        self._staging: Future | None = None
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
            use_non_blocking_copy=cuda)) if asynchronous else None
        self._pending_step: int | None = None
        self._landed = threading.Event()
        self._landed.set()
        self.blocking_s: list[float] = []          # time the training loop was blocked per save
        self.finalize_error: BaseException | None = None

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, extra: dict) -> None:
        """Checkpoint the state after ``step``; ``extra`` is this rank's small state (pickled).

        Waits for the previous asynchronous save first (DCP allows one in flight).
        """
        start = time.perf_counter()
        self.wait()
        tmp = self.folder / f"tmp-{checkpoint_name(step)}"
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(extra, tmp / f"extra_rank{self.rank}.pt")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=FLAT_OPTIM)
        state = {"model": self._chunk_free(model_sd), "optim": self._chunk_free(optim_sd)}
        self._pending_step = step
        self._landed.clear()
        if self.asynchronous:
            response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group,
                                      async_stager=self._stager)
            self._staging, self._future = response.staging_completion, response.upload_completion
            self._future.add_done_callback(lambda fut: self._finish(fut, step, tmp))
        else:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
            done: Future = Future()
            done.set_result(None)
            self._finish(done, step, tmp)
        self.blocking_s.append(time.perf_counter() - start)

    def _finish(self, fut: Future, step: int, tmp: Path) -> None:
        """When this rank's save is done; rank 0 (whose future completes last, after the
        save's final gather) writes the manifest, renames, updates ``latest`` and prunes."""
        try:
            if fut.exception() is not None or self.rank != 0:
                return
            write_manifest(tmp, step)
            if self.corrupt_at(step):
                # Injected damage lands before the rename: a rank that sees the checkpoint in
                # place (`wait_landed`) sees it damaged, as a disk fault after the write would
                # leave it; the manifest's checksums are of the good bytes.
                shard = max((p for p in tmp.iterdir() if p.suffix == ".distcp"),
                            key=lambda p: p.stat().st_size)
                corrupt_file(shard)
            final = self.folder / checkpoint_name(step)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            latest_tmp = self.folder / "latest.tmp"
            latest_tmp.write_text(final.name + "\n")
            os.replace(latest_tmp, self.folder / "latest")
            for old in list_checkpoints(self.folder)[self.keep:]:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException as exc:             # surfaced by wait(); a thread cannot raise
            self.finalize_error = exc
        finally:
            self._landed.set()

    def wait_staged(self) -> None:
        """Block until the in-flight save has copied the state (call before the optimizer
        step); the wait counts as blocking time of that save."""
        if self._staging is not None:
            start = time.perf_counter()
            self._staging.result()
            self._staging = None
            self.blocking_s[-1] += time.perf_counter() - start

    def close(self) -> None:
        """Wait for the in-flight save and stop the staging thread."""
        self.wait()
        if self._stager is not None:
            self._stager.close()

    def wait(self) -> None:
        """Block until this rank's in-flight save is written (rank 0: and finalized)."""
        self.wait_staged()
        if self._future is not None:
            self._future.result()
            self._future = None
        self._landed.wait()
        if self.finalize_error is not None:
            raise RuntimeError(f"checkpoint finalize failed: {self.finalize_error}")

    def wait_landed(self, timeout_s: float = LAND_TIMEOUT_S) -> None:
        """Block until the in-flight checkpoint is renamed into place (any rank; used before
        an injected failure so that the checkpoint it resumes from is known)."""
        self.wait()
        if self._pending_step is None:
            return
        final = self.folder / checkpoint_name(self._pending_step) / MANIFEST
        deadline = time.monotonic() + timeout_s
        while not final.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    # -- loading ---------------------------------------------------------------------------
    def load_latest(self, folder: str | os.PathLike | None = None
                    ) -> tuple[int, dict | None, list[str]]:
        """Load the newest checkpoint that verifies (collective: every rank calls it).

        Args:
            folder: where to look (default: this manager's folder).
        Returns:
            (its step, this rank's ``extra`` dict (`load_extra`: another rank's, marked, when
            the checkpoint was written by a different number of ranks), one line per damaged
            checkpoint skipped); (0, None, lines) when there is none.
        """
        folder = Path(folder) if folder is not None else self.folder
        choice: list = [None, []]
        if self.rank == 0:
            skipped = []
            for candidate in list_checkpoints(folder):
                problem = verify(candidate)
                if problem is None:
                    choice = [str(candidate), skipped]
                    break
                skipped.append(f"checkpoint {candidate.name} is damaged ({problem}); "
                               "falling back to the previous one")
            else:
                choice = [None, skipped]
            for leftover in folder.glob("tmp-step*") if folder.is_dir() else []:
                shutil.rmtree(leftover, ignore_errors=True)    # unfinished saves
        dist.broadcast_object_list(choice, src=0)
        path, skipped = choice
        if path is None:
            return 0, None, skipped
        options = FLAT_OPTIM if _flat_optimizer_keys(Path(path)) else StateDictOptions()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        chunk_free = options is FLAT_OPTIM and not _chunk_indexed_keys(Path(path))
        keyed = self._chunk_free if chunk_free else dict
        state = {"model": keyed(model_sd), "optim": keyed(optim_sd)}
        dcp.load(state, checkpoint_id=path)
        if chunk_free:       # back to this rank's own keys (DCP replaced non-tensor values)
            state = {"model": {k: state["model"][chunk_free_key(k)] for k in model_sd},
                     "optim": {k: state["optim"][chunk_free_key(k)] for k in optim_sd}}
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
        return int(json.loads((Path(path) / MANIFEST).read_text())["step"]), \
            load_extra(Path(path), self.rank, dist.get_world_size()), skipped


    def _chunk_free(self, state: dict) -> dict:
        """``state`` keyed as on every layout (`chunk_free_key`); unchanged for one chunk."""
        return _rekey(state, chunk_free_key) if isinstance(self.model, torch.nn.ModuleList) \
            else state


def _chunk_indexed_keys(folder: Path) -> bool:
    """Whether checkpoint ``folder`` was written by an interleaved pipeline before keys were
    made chunk-free (``model.0.tok.weight``); it loads on the same layout only."""
    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return any(re.match(r"model\.\d+\.", key) for key in keys)


def _flat_optimizer_keys(folder: Path) -> bool:
    """Whether checkpoint ``folder`` keys its optimizer param groups by FQN (`FLAT_OPTIM`);
    False for a checkpoint written before that (``optim.param_groups.0.lr``), which loads in
    the list form (correct on a layout with one pipeline stage per rank set, as it was saved)."""
    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return "optim.param_groups.0.lr" not in keys        # no parameter's FQN is "0"


def saved_world_size(folder: Path) -> int:
    """Ranks that wrote checkpoint ``folder``: its ``extra_rank{r}.pt`` files."""
    return sum(1 for p in folder.glob("extra_rank*.pt"))


def load_extra(folder: Path, rank: int, world_size: int) -> dict:
    """Rank ``rank``'s small state from checkpoint ``folder`` in a job of ``world_size`` ranks.

    Written by as many ranks: the rank's own ``extra_rank{rank}.pt``. Written by a different
    number (a resume on another layout): rank 0's file, for its job-wide fields (step, global
    samples consumed, global batch), with ``"resharded_from": saved world size`` added; its
    per-rank fields (RNG, DP rank) describe another process, and `runtime.resilience` re-derives
    them.

    Raises:
        FileNotFoundError: the folder holds no ``extra_rank0.pt``.
    """
    saved = saved_world_size(folder)
    if saved == world_size:
        return torch.load(folder / f"extra_rank{rank}.pt", weights_only=False)
    first = folder / "extra_rank0.pt"
    if not first.is_file():
        raise FileNotFoundError(f"checkpoint {folder.name} has no extra_rank0.pt (data "
                                "position and RNG states); it cannot be resumed")
    return torch.load(first, weights_only=False) | {"resharded_from": saved}


def rng_state() -> dict:
    """This process's random number generator states (CPU and, when present, CUDA)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
