"""Asynchronous, atomic, verified training checkpoints with `torch.distributed.checkpoint`.

Layout of a checkpoint folder::

    DIR/step00000006/.metadata, __0_0.distcp, __1_0.distcp   DCP: model + optimizer, sharded
    DIR/step00000006/extra_rank{r}.pt                          rank r: RNG states, data position
                                                               (and the job's world size, mesh)
    DIR/step00000006/manifest.json                             sha256 and size of every file
    DIR/latest                                                 name of the newest checkpoint

``DIR`` is a local folder or an object-store prefix ``s3://bucket/prefix`` (`CheckpointStore`;
DCP writes it through fsspec, `torch.distributed.checkpoint.FsspecWriter`, with s3fs). How a
checkpoint becomes visible only once complete:

- on a local disk, a save writes into ``DIR/tmp-step...`` and rank 0 renames it to
  ``DIR/step...`` only after every rank's shard and the manifest are on disk (``os.rename`` of
  a folder is atomic on POSIX), so a crash mid-write never leaves a folder that looks complete;
- an object store has no rename (s3fs "renames" by copying every object, which doubles the
  write and is not atomic), so the shards are written under ``DIR/step.../`` directly and the
  manifest is the commit point: rank 0 writes ``manifest.json`` with one PUT after every rank's
  shards are stored, and only a ``step.../`` prefix holding a manifest counts as a checkpoint
  (a PUT is atomic: a reader sees the whole object or none; S3 and radosgw read after write
  consistently). Until then the prefix is a temporary one, ignored by readers and removed at
  the next load; pruning deletes a manifest before the rest, so a half-deleted checkpoint is
  never seen as complete. A re-save of a step that already has a checkpoint (after a fallback
  from a damaged one) first removes the old objects, before any rank writes.

``latest`` is replaced atomically on both (``os.replace``; one PUT). The newest ``keep`` are kept.
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
import io
import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import fsspec  # a torch dependency; its s3:// scheme is s3fs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

# DCP's fsspec storage; torch 2.13 does not re-export it from torch.distributed.checkpoint
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from runtime.faults import corrupt_bytes

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


#: URL schemes of object stores (s3fs; S3-compatible servers such as Ceph's radosgw).
OBJECT_STORE_SCHEMES = ("s3",)


def is_object_store(location: str | os.PathLike) -> bool:
    """Whether ``location`` is an object-store URL (``s3://bucket/prefix``), not a local path."""
    return isinstance(location, str) and urlparse(location).scheme in OBJECT_STORE_SCHEMES


def checkpoint_location(location: str | os.PathLike) -> Path | str:
    """``location`` as the checkpoint functions take it: a `Path`, or an object-store URL
    without a trailing slash (a URL must stay a string: `Path` would fold ``s3://`` to
    ``s3:/``)."""
    return location.rstrip("/") if is_object_store(location) else Path(location)


def location_name(location: str | os.PathLike) -> str:
    """Last component of a path or URL (a checkpoint's ``step...`` name)."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def join(location: Path | str, *names: str) -> Path | str:
    """``location / names``, for a `Path` or an object-store URL."""
    if isinstance(location, Path):
        return location.joinpath(*names)
    return "/".join([location.rstrip("/"), *names])


#: s3fs options of every object-store client here, DCP's included (one cached instance):
#: other processes write into the same prefixes, so no listing may come from a cache.
S3_OPTIONS = {"use_listings_cache": False}


class CheckpointStore:
    """File operations of checkpoints in a local folder or under an object-store prefix.

    The local folder uses the OS (and ``os.rename`` as the commit); the object store uses
    fsspec's s3fs, configured as boto is (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_ENDPOINT_URL`` for a server other than AWS, e.g. radosgw), with no listing cache:
    other ranks write into the same prefix, so every listing must ask the server.

    Args:
        location: a folder, or ``s3://bucket/prefix``.
    """

    def __init__(self, location: str | os.PathLike) -> None:
        self.location = checkpoint_location(location)
        self.remote = not isinstance(self.location, Path)
        if self.remote:
            self.fs = fsspec.filesystem("s3", **S3_OPTIONS)

    def _key(self, location: Path | str) -> str:
        return str(location).split("://", 1)[1]

    def url(self, *names: str) -> Path | str:
        return join(self.location, *names)

    # -- single objects ----------------------------------------------------------------------
    def read_bytes(self, location: Path | str) -> bytes:
        if not self.remote:
            return Path(location).read_bytes()
        return self.fs.cat_file(self._key(location))

    def write_bytes(self, location: Path | str, data: bytes) -> None:
        """Write a whole file atomically (local: a temporary file and ``os.replace``; object
        store: one PUT)."""
        if not self.remote:
            tmp = Path(str(location) + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, location)
            return
        self.fs.pipe_file(self._key(location), data)

    def remove_file(self, location: Path | str) -> None:
        if not self.remote:
            Path(location).unlink()
        else:
            self.fs.rm_file(self._key(location))

    def exists(self, location: Path | str) -> bool:
        return Path(location).exists() if not self.remote else self.fs.exists(self._key(location))

    def files(self, folder: Path | str) -> dict[str, int]:
        """``{file name: size in bytes}`` of the files directly in ``folder`` ({} if none)."""
        if not self.remote:
            folder = Path(folder)
            return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()} \
                if folder.is_dir() else {}
        try:
            entries = self.fs.ls(self._key(folder), detail=True)
        except FileNotFoundError:
            return {}
        return {location_name(e["name"]): int(e["size"]) for e in sorted(
            entries, key=lambda e: e["name"]) if e["type"] == "file"}

    def sha256(self, location: Path | str) -> str:
        digest = hashlib.sha256()
        opener = Path(location).open("rb") if not self.remote else \
            self.fs.open(self._key(location), "rb", block_size=8 << 20)
        with opener as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()

    # -- checkpoint folders ------------------------------------------------------------------
    def children(self, prefix: str) -> list[Path | str]:
        """Sub-folders of the store whose names start with ``prefix``, sorted by name."""
        if not self.remote:
            folder = self.location
            return sorted(p for p in folder.iterdir() if p.is_dir() and
                          p.name.startswith(prefix)) if folder.is_dir() else []
        try:
            entries = self.fs.ls(self._key(self.location), detail=True)
        except FileNotFoundError:
            return []
        return sorted(self.url(location_name(e["name"])) for e in entries
                      if e["type"] == "directory" and location_name(e["name"]).startswith(prefix))

    def scan(self) -> tuple[list[Path | str], list[Path | str]]:
        """(finished checkpoints newest first, folders of saves that never finished).

        Finished: local ``step*`` folders (only a finished save is renamed to that name);
        object-store ``step*/`` prefixes with a manifest (the commit point, module docstring).
        Unfinished: local ``tmp-step*``; object-store ``step*/`` prefixes without one. On an
        object store this lists the store once and each ``step*/`` prefix once (N + 1 LIST
        requests for N folders).
        """
        if not self.remote:
            return self.children("step")[::-1], self.children("tmp-step")
        finished, unfinished = [], []
        for folder in self.children("step"):
            (finished if MANIFEST in self.files(folder) else unfinished).append(folder)
        return finished[::-1], unfinished

    def checkpoints(self) -> list[Path | str]:
        """Finished checkpoints, newest first (`scan`)."""
        return self.scan()[0]

    def unfinished(self) -> list[Path | str]:
        """Folders of saves that never finished (`scan`)."""
        return self.scan()[1]

    def remove(self, folder: Path | str) -> None:
        """Delete a checkpoint folder (object store: its manifest first, module docstring)."""
        if not self.remote:
            shutil.rmtree(folder, ignore_errors=True)
            return
        key = self._key(folder)
        try:
            self.fs.rm_file(f"{key}/{MANIFEST}")
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(key, recursive=True)
        except FileNotFoundError:
            pass

    def writer(self, folder: Path | str):
        """DCP storage writer of checkpoint ``folder``. The object store's skips fsync:
        a stored PUT is durable, and DCP falls back to ``os.sync()`` of the whole machine on a
        stream without a file descriptor."""
        if not self.remote:
            return FileSystemWriter(str(folder))
        return FsspecWriter(str(folder), sync_files=False, **S3_OPTIONS)

    def reader(self, folder: Path | str):
        if not self.remote:
            return FileSystemReader(str(folder))
        return FsspecReader(str(folder), **S3_OPTIONS)


def parent_location(location: str | os.PathLike) -> Path | str:
    """The folder (or object-store prefix) that holds ``location``."""
    location = checkpoint_location(location)
    return location.parent if isinstance(location, Path) else location.rsplit("/", 1)[0]


def store_of(checkpoint: Path | str) -> CheckpointStore:
    """The store that holds checkpoint folder ``checkpoint`` (its parent)."""
    return CheckpointStore(parent_location(checkpoint))


def build_manifest(folder: Path | str, step: int) -> dict:
    """The manifest of checkpoint ``folder``: sha256 and size of every file but the manifest."""
    store = store_of(folder)
    files = {name: {"sha256": store.sha256(join(folder, name)), "size_bytes": size}
             for name, size in store.files(folder).items()
             if name not in (MANIFEST, MANIFEST + ".tmp")}
    return {"step": step, "files": files, "time_unix_s": time.time()}


def write_manifest(folder: Path | str, step: int, manifest: dict | None = None) -> dict:
    """Write ``folder/manifest.json`` (``manifest``, default `build_manifest`) and return it."""
    manifest = manifest or build_manifest(folder, step)
    store_of(folder).write_bytes(join(folder, MANIFEST), json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(folder: Path | str) -> dict:
    return json.loads(store_of(folder).read_bytes(join(folder, MANIFEST)))


def verify(folder: Path | str) -> str | None:
    """None when every file matches the manifest, else what is wrong (one line)."""
    folder = checkpoint_location(folder)
    store, name = store_of(folder), location_name(folder)
    present = store.files(folder)
    if MANIFEST not in present:
        return f"{name} has no {MANIFEST}"
    for file, entry in read_manifest(folder)["files"].items():
        if file not in present:
            return f"{name}/{file} is missing"
        if present[file] != entry["size_bytes"]:
            return f"{name}/{file} has {present[file]} bytes, manifest says " \
                   f"{entry['size_bytes']}"
        if store.sha256(join(folder, file)) != entry["sha256"]:
            return f"{name}/{file} fails its sha256 check"
    return None


def list_checkpoints(folder: str | os.PathLike) -> list[Path | str]:
    """Finished checkpoints in ``folder`` (a path or an object-store URL), newest first
    (temporary folders excluded)."""
    return CheckpointStore(folder).checkpoints()


def is_checkpoint(location: str | os.PathLike) -> bool:
    """Whether ``location`` is one finished checkpoint (a ``step*`` folder or prefix with its
    manifest, module docstring), not a folder of them."""
    location = checkpoint_location(location)
    return location_name(location).startswith("step") and \
        MANIFEST in store_of(location).files(location)


def resume_candidates(location: str | os.PathLike) -> list[Path | str]:
    """The checkpoints a resume from ``location`` may load, newest first: ``location``
    itself when it is one checkpoint (`is_checkpoint`: that one, no fallback), else the
    finished checkpoints in it (`list_checkpoints`)."""
    return [checkpoint_location(location)] if is_checkpoint(location) else \
        list_checkpoints(location)


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
        folder: the checkpoint folder (shared by all ranks): a path or ``s3://bucket/prefix``.
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
        self.store = CheckpointStore(folder)
        self.folder = self.store.location
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
        if self.store.remote:
            # the step's prefix is the temporary folder until its manifest lands (module
            # docstring); objects of an earlier save of this step go before anyone writes
            tmp = self.store.url(checkpoint_name(step))
            if self.rank == 0 and self.store.files(tmp):
                self.store.remove(tmp)
            dist.barrier(group=self.group)
        else:
            tmp = self.folder / f"tmp-{checkpoint_name(step)}"
            tmp.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        self.store.write_bytes(join(tmp, f"extra_rank{self.rank}.pt"), buffer.getvalue())
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=FLAT_OPTIM)
        state = {"model": self._chunk_free(model_sd), "optim": self._chunk_free(optim_sd)}
        self._pending_step = step
        self._landed.clear()
        if self.asynchronous:
            response = dcp.async_save(state, storage_writer=self.store.writer(tmp),
                                      process_group=self.group, async_stager=self._stager)
            self._staging, self._future = response.staging_completion, response.upload_completion
            self._future.add_done_callback(lambda fut: self._finish(fut, step, tmp))
        else:
            dcp.save(state, storage_writer=self.store.writer(tmp), process_group=self.group)
            done: Future = Future()
            done.set_result(None)
            self._finish(done, step, tmp)
        self.blocking_s.append(time.perf_counter() - start)

    def _finish(self, fut: Future, step: int, tmp: Path | str) -> None:
        """When this rank's save is done; rank 0 (whose future completes last, after the
        save's final gather) writes the manifest, commits (local: renames), updates
        ``latest`` and prunes."""
        try:
            if fut.exception() is not None or self.rank != 0:
                return
            store = self.store
            manifest = build_manifest(tmp, step)
            if self.corrupt_at(step):
                # Injected damage lands before the commit: a rank that sees the checkpoint in
                # place (`wait_landed`) sees it damaged, as a disk fault after the write would
                # leave it; the manifest's checksums are of the good bytes.
                shard = max((n for n in manifest["files"] if n.endswith(".distcp")),
                            key=lambda n: manifest["files"][n]["size_bytes"])
                store.write_bytes(join(tmp, shard), corrupt_bytes(
                    store.read_bytes(join(tmp, shard))))
            write_manifest(tmp, step, manifest)        # the object store's commit point
            final = store.url(checkpoint_name(step))
            if not store.remote:
                if final.exists():
                    shutil.rmtree(final)
                os.rename(tmp, final)           # the local commit point
            store.write_bytes(store.url("latest"), (location_name(final) + "\n").encode())
            for old in store.checkpoints()[self.keep:]:
                store.remove(old)
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
        final = self.store.url(checkpoint_name(self._pending_step), MANIFEST)
        deadline = time.monotonic() + timeout_s
        while not self.store.exists(final) and time.monotonic() < deadline:
            time.sleep(0.02)

    # -- loading ---------------------------------------------------------------------------
    def load_latest(self, folder: str | os.PathLike | None = None
                    ) -> tuple[int, dict | None, list[str]]:
        """Load the newest checkpoint that verifies (collective: every rank calls it).

        Args:
            folder: where to look, a path or an object-store URL (default: this manager's
                folder); or one checkpoint (`is_checkpoint`), loaded if it verifies.
        Returns:
            (its step, this rank's ``extra`` dict (`load_extra`: another rank's, marked, when
            the checkpoint was written by a different number of ranks), one line per damaged
            checkpoint skipped); (0, None, lines) when there is none.
        """
        store = CheckpointStore(folder) if folder is not None else self.store
        choice: list = [None, []]
        if self.rank == 0:
            skipped = []
            finished, unfinished = ([checkpoint_location(folder)], []) \
                if folder is not None and is_checkpoint(folder) else store.scan()
            for candidate in finished:
                problem = verify(candidate)
                if problem is None:
                    choice = [str(candidate), skipped]
                    break
                skipped.append(f"checkpoint {location_name(candidate)} is damaged ({problem}); "
                               "falling back to the previous one")
            else:
                choice = [None, skipped]
            for leftover in unfinished:
                store.remove(leftover)                         # unfinished saves
        dist.broadcast_object_list(choice, src=0)
        path, skipped = choice
        if path is None:
            return 0, None, skipped
        path = checkpoint_location(path)
        keys = _saved_keys(path)                 # one metadata read for both key questions
        options = FLAT_OPTIM if _flat_optimizer_keys(keys) else StateDictOptions()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        chunk_free = options is FLAT_OPTIM and not _chunk_indexed_keys(keys)
        keyed = self._chunk_free if chunk_free else dict
        state = {"model": keyed(model_sd), "optim": keyed(optim_sd)}
        dcp.load(state, storage_reader=store.reader(path))
        if chunk_free:       # back to this rank's own keys (DCP replaced non-tensor values)
            state = {"model": {k: state["model"][chunk_free_key(k)] for k in model_sd},
                     "optim": {k: state["optim"][chunk_free_key(k)] for k in optim_sd}}
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
        return int(read_manifest(path)["step"]), \
            load_extra(path, self.rank, dist.get_world_size()), skipped


    def _chunk_free(self, state: dict) -> dict:
        """``state`` keyed as on every layout (`chunk_free_key`); unchanged for one chunk."""
        return _rekey(state, chunk_free_key) if isinstance(self.model, torch.nn.ModuleList) \
            else state


def _saved_keys(folder: Path | str) -> set[str]:
    """The state-dict keys in checkpoint ``folder``'s DCP metadata (one read of it)."""
    return set(store_of(folder).reader(folder).read_metadata().state_dict_metadata)


def _chunk_indexed_keys(keys: set[str]) -> bool:
    """Whether a checkpoint with these keys was written by an interleaved pipeline before keys
    were made chunk-free (``model.0.tok.weight``); it loads on the same layout only."""
    return any(re.match(r"model\.\d+\.", key) for key in keys)


def _flat_optimizer_keys(keys: set[str]) -> bool:
    """Whether a checkpoint with these keys keys its optimizer param groups by FQN
    (`FLAT_OPTIM`); False for a checkpoint written before that (``optim.param_groups.0.lr``),
    which loads in the list form (correct on a layout with one pipeline stage per rank set, as
    it was saved)."""
    return "optim.param_groups.0.lr" not in keys        # no parameter's FQN is "0"


def saved_world_size(folder: Path | str, files: dict[str, int] | None = None) -> int:
    """Ranks that wrote checkpoint ``folder``: its ``extra_rank{r}.pt`` files (from ``files``,
    its listing, when the caller has it)."""
    files = store_of(folder).files(folder) if files is None else files
    return sum(1 for name in files if re.fullmatch(r"extra_rank\d+\.pt", name))


def load_extra(folder: Path | str, rank: int, world_size: int) -> dict:
    """Rank ``rank``'s small state from checkpoint ``folder`` in a job of ``world_size`` ranks.

    Written by as many ranks: the rank's own ``extra_rank{rank}.pt``. Written by a different
    number (a resume on another layout): rank 0's file, for its job-wide fields (step, global
    samples consumed, global batch), with ``"resharded_from": saved world size`` added; its
    per-rank fields (RNG, DP rank) describe another process, and `runtime.resilience` re-derives
    them.

    Raises:
        FileNotFoundError: the folder holds no ``extra_rank0.pt``.
    """
    folder = checkpoint_location(folder)
    store = store_of(folder)

    def load(name: str) -> dict:
        return torch.load(io.BytesIO(store.read_bytes(join(folder, name))), weights_only=False)
    files = store.files(folder)
    saved = saved_world_size(folder, files)
    if saved == world_size:
        return load(f"extra_rank{rank}.pt")
    if "extra_rank0.pt" not in files:
        raise FileNotFoundError(f"checkpoint {location_name(folder)} has no extra_rank0.pt "
                                "(data position and RNG states); it cannot be resumed")
    return load("extra_rank0.pt") | {"resharded_from": saved}


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
