"""Checkpoints in an object store: DCP through fsspec/s3fs against a real S3 server.

The server is Debian's radosgw on a one-node Ceph started on 127.0.0.1 for this module
(`runtime.radosgw`); without the Ceph packages the module skips and says which programs are
missing (`make test` installs them as root). What each test compares with is a local-disk run
of the same code: the object store must change where the bytes go, nothing else. The killed
2-rank job is in the default suite; the ``--resume s3://`` job (two more runs) is ``slow``.
"""

from __future__ import annotations

import json

import pytest

from runtime.checkpoint import (
    MANIFEST,
    CheckpointManager,
    CheckpointStore,
    checkpoint_name,
    list_checkpoints,
    rng_state,
    verify,
)
from runtime.launch import resume_clause
from runtime.radosgw import Radosgw, missing_binaries
from tests.runtime.test_checkpoint import (  # noqa: F401 - process_group: a fixture
    make_state,
    process_group,
    train_steps,
)

# the 2-rank job of the local-disk fault tests, and its uninterrupted run (fixtures)
from tests.runtime.test_faults import (  # noqa: F401 - plan_path, uninterrupted: fixtures
    assert_same_job,
    consumed,
    launch,
    plan_path,
    uninterrupted,
)

pytestmark = pytest.mark.skipif(
    bool(missing_binaries()),
    reason=f"Ceph programs not found ({', '.join(missing_binaries())}): install Debian's "
           "ceph-mon ceph-osd radosgw ceph-common (make test does as root)")


@pytest.fixture(scope="module")
def radosgw(tmp_path_factory):
    """A running radosgw with credentials in the environment (what s3fs and a torchrun
    worker read); stopped, with every daemon, after the module."""
    gw = Radosgw(tmp_path_factory.mktemp("ceph")).start()
    print(f"radosgw up in {gw.startup_s:.1f} s")
    mp = pytest.MonkeyPatch()
    for key, value in gw.env.items():
        mp.setenv(key, value)
    try:
        yield gw
    finally:
        mp.undo()
        gw.stop()


@pytest.fixture
def bucket(radosgw, request):
    """A fresh bucket per test: ``s3://<name>``."""
    name = "t" + str(abs(hash(request.node.name)) % 10**10)
    store = CheckpointStore(f"s3://{name}")
    store.fs.mkdir(name)
    return f"s3://{name}"


def test_radosgw_is_a_real_s3_server(radosgw, bucket):
    store = CheckpointStore(bucket)
    store.write_bytes(f"{bucket}/a/b.txt", b"hello")
    assert store.read_bytes(f"{bucket}/a/b.txt") == b"hello"
    assert store.files(f"{bucket}/a") == {"b.txt": 5}
    # the daemons are separate processes on 127.0.0.1, not a library inside this one
    assert {"mon.a", "osd.0", "client.rgw"} <= set(radosgw.procs)
    assert all(p.poll() is None for p in radosgw.procs.values())


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_object_store_resume_equals_local_disk(bucket, tmp_path, asynchronous):
    """The same save / train / load sequence on a local folder and in the object store gives
    the same losses after the load (the local one is the reference)."""
    losses = {}
    for where in (str(tmp_path / "local"), f"{bucket}/run"):
        model, optimizer = make_state()
        manager = CheckpointManager(where, [model], optimizer, asynchronous=asynchronous,
                                    keep=2)
        train_steps(model, optimizer, 3)
        manager.save(3, {"rng": rng_state(), "note": "three"})
        manager.wait()
        train_steps(model, optimizer, 2, start=3)
        fresh, fresh_opt = make_state(seed=1)
        step, extra, skipped = CheckpointManager(where, [fresh], fresh_opt).load_latest()
        assert (step, extra["note"], skipped) == (3, "three", [])
        losses["s3" if where.startswith("s3://") else "local"] = \
            train_steps(fresh, fresh_opt, 2, start=3)
        manager.close()
    assert losses["s3"] == losses["local"]          # bitwise (CPU, fp32)


def test_manifest_latest_keep_and_uncommitted_prefixes(bucket):
    where = f"{bucket}/ck"
    store = CheckpointStore(where)
    model, optimizer = make_state()
    manager = CheckpointManager(where, [model], optimizer, keep=2)
    for step in (1, 2, 3):
        train_steps(model, optimizer, 1, start=step)
        manager.save(step, {"step": step})
    manager.close()
    assert list_checkpoints(where) == [f"{where}/{checkpoint_name(s)}" for s in (3, 2)]
    assert store.read_bytes(f"{where}/latest") == f"{checkpoint_name(3)}\n".encode()
    newest = f"{where}/{checkpoint_name(3)}"
    manifest = json.loads(store.read_bytes(f"{newest}/{MANIFEST}"))
    files = store.files(newest)
    # every object but the manifest is listed with its size (the server's own figure)
    assert {n: e["size_bytes"] for n, e in manifest["files"].items()} == \
        {n: s for n, s in files.items() if n != MANIFEST}
    assert {".metadata", "__0_0.distcp", "extra_rank0.pt"} <= set(manifest["files"])
    assert verify(newest) is None
    # a prefix without a manifest is a save that never finished: not a checkpoint
    store.write_bytes(f"{where}/{checkpoint_name(9)}/__0_0.distcp", b"partial")
    assert list_checkpoints(where)[0] == newest
    # damage the newest checkpoint's shard: the load falls back and cleans the partial save
    shard = f"{newest}/__0_0.distcp"
    data = bytearray(store.read_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(shard, bytes(data))
    assert "fails its sha256 check" in verify(newest)
    fresh, fresh_opt = make_state(seed=1)
    step, extra, skipped = CheckpointManager(where, [fresh], fresh_opt).load_latest()
    assert (step, extra["step"]) == (2, 2)
    assert len(skipped) == 1 and checkpoint_name(3) in skipped[0]
    assert store.files(f"{where}/{checkpoint_name(9)}") == {}


def test_killed_job_resumes_from_the_object_store(
        bucket, plan_path, tmp_path, uninterrupted):  # noqa: F811 - pytest fixtures
    """A 2-rank tiny-gpt job checkpointing to s3:// loses rank 1 at step 7, restarts from the
    object store's step-6 checkpoint and ends with the losses (bitwise) and the ordered
    sample ids of the uninterrupted local-disk job (`tests.runtime.test_faults`)."""
    where = f"{bucket}/job"
    summary = launch(plan_path, tmp_path, inject=["kill:rank=1,step=7"],
                     checkpoint_dir=where)
    assert_same_job(summary, tmp_path, uninterrupted)
    assert summary["restarts"] == 1 and summary["steps_lost"] == 1
    assert not (tmp_path / "checkpoints").exists()          # nothing went to the local disk
    # --keep 2 of the saves after steps 3, 6, 9 and 10, each one DCP shard per rank
    newest = list_checkpoints(where)
    assert newest == [f"{where}/{checkpoint_name(s)}" for s in (10, 9)]
    files = CheckpointStore(where).files(newest[0])
    assert {"__0_0.distcp", "__1_0.distcp", "extra_rank0.pt", "extra_rank1.pt"} <= set(files)
    assert verify(newest[0]) is None
    # a failure message's resume command points at the object store, not at OUT/checkpoints
    clause = resume_clause(plan_path, tmp_path, 10, ["--checkpoint-dir", where])
    assert f"newest checkpoint {checkpoint_name(10)}" in clause
    assert f"--resume {where} --checkpoint-dir {where}" in clause


@pytest.mark.slow
def test_resume_from_the_object_store_continues_the_job(
        bucket, plan_path, tmp_path, uninterrupted):  # noqa: F811 - pytest fixtures
    """``--resume s3://...`` of a job stopped after step 6 trains steps 7-10 as the
    uninterrupted job did (losses bitwise, the same samples)."""
    where = f"{bucket}/first"
    first = launch(plan_path, tmp_path / "first", steps=6, checkpoint_dir=where)
    second = launch(plan_path, tmp_path / "second", resume=where)
    want, want_ids = uninterrupted
    assert first["losses"] == want["losses"][:6]
    assert second["losses"][-4:] == want["losses"][6:]
    ids = consumed(tmp_path / "second")
    assert {r: v[-4 * 4:] for r, v in ids.items()} == {r: v[6 * 4:] for r, v in want_ids.items()}


def test_an_unwritable_bucket_is_one_line_and_exit_2_before_any_worker(
        radosgw, plan_path, tmp_path, capsys):  # noqa: F811 - pytest fixture
    """``meshplan run --checkpoint-dir s3://<bucket that does not exist>/...`` is refused by
    the write probe before torchrun starts: exit 2, one line naming the location."""
    from apps.cli import main
    code = main(["run", str(plan_path), "--steps", "2", "--checkpoint-every", "1",
                 "--out", str(tmp_path / "out"), "--checkpoint-dir", "s3://no-such-bucket/x"])
    err = capsys.readouterr().err
    assert code == 2
    assert "s3://no-such-bucket/x" in err and "create the bucket" in err
    assert "Traceback" not in err and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_injected_damage_is_in_place_when_the_checkpoint_commits(bucket):
    """``corrupt-checkpoint:step=2`` damages step 2's largest shard before its manifest (the
    commit point) lands, so the load skips it and takes step 1, as on a disk."""
    where = f"{bucket}/damaged"
    model, optimizer = make_state()
    manager = CheckpointManager(where, [model], optimizer, keep=3,
                                corrupt_at=lambda step: step == 2)
    for step in (1, 2):
        manager.save(step, {"step": step})
    manager.close()
    assert verify(f"{where}/{checkpoint_name(1)}") is None
    assert "fails its sha256 check" in verify(f"{where}/{checkpoint_name(2)}")
    fresh, fresh_opt = make_state(seed=1)
    step, extra, skipped = CheckpointManager(where, [fresh], fresh_opt).load_latest()
    assert (step, extra["step"], len(skipped)) == (1, 1, 1)
