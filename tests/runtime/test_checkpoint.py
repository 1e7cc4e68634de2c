"""Checkpoints are atomic, verified and pruned; a load restores model and optimizer exactly.

One process, a world-size-1 gloo group: DCP runs the same code as in a multi-rank job.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from runtime.checkpoint import (
    CheckpointManager,
    checkpoint_name,
    list_checkpoints,
    rng_state,
    set_rng_state,
    verify,
)
from runtime.faults import corrupt_file


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_state(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train_steps(model, optimizer, steps: int, start: int = 0,
                before_step=lambda: None) -> list[float]:
    losses = []
    for k in range(start, start + steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))   # (B, 8)
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        before_step()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_resume_continues_bitwise(tmp_path, asynchronous):
    model, optimizer = make_state()
    manager = CheckpointManager(tmp_path, [model], optimizer, asynchronous=asynchronous)
    train_steps(model, optimizer, 3)
    manager.save(3, {"rng": rng_state(), "note": "three"})
    # Training goes on while the save runs; as in the training loop (runtime/resilience.py), the
    # in-place optimizer step waits for the background copy (wait_staged): no torn checkpoint.
    expected = train_steps(model, optimizer, 2, start=3, before_step=manager.wait_staged)
    manager.wait()

    fresh, fresh_opt = make_state(seed=1)
    resumed = CheckpointManager(tmp_path, [fresh], fresh_opt)
    step, extra, skipped = resumed.load_latest()
    assert (step, extra["note"], skipped) == (3, "three", [])
    assert train_steps(fresh, fresh_opt, 2, start=3) == expected


def test_checkpoint_is_renamed_into_place_with_a_manifest(tmp_path):
    model, optimizer = make_state()
    manager = CheckpointManager(tmp_path, [model], optimizer)
    manager.save(5, {})
    manager.wait()
    folder = tmp_path / checkpoint_name(5)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {".metadata", "extra_rank0.pt"} <= set(manifest["files"])
    assert verify(folder) is None
    assert (tmp_path / "latest").read_text().strip() == folder.name
    assert not list(tmp_path.glob("tmp-*"))


def test_newest_n_are_kept(tmp_path):
    model, optimizer = make_state()
    manager = CheckpointManager(tmp_path, [model], optimizer, keep=2)
    for step in (1, 2, 3, 4):
        train_steps(model, optimizer, 1)
        manager.save(step, {})
    manager.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == [checkpoint_name(4),
                                                            checkpoint_name(3)]


def test_damaged_newest_falls_back_and_unfinished_is_ignored(tmp_path):
    model, optimizer = make_state()
    manager = CheckpointManager(tmp_path, [model], optimizer, keep=3)
    manager.save(1, {"step": 1})
    manager.wait()
    train_steps(model, optimizer, 1)
    manager.save(2, {"step": 2})
    manager.wait()
    shard = next((tmp_path / checkpoint_name(2)).glob("*.distcp"))
    corrupt_file(shard)
    (tmp_path / "tmp-step00000003").mkdir()                    # a crash mid-write
    assert "fails its sha256 check" in verify(tmp_path / checkpoint_name(2))
    step, extra, skipped = CheckpointManager(tmp_path, [model], optimizer).load_latest()
    assert (step, extra["step"]) == (1, 1)
    assert len(skipped) == 1 and "step00000002" in skipped[0]
    assert not (tmp_path / "tmp-step00000003").exists()


def test_corrupt_at_damages_that_checkpoint(tmp_path):
    model, optimizer = make_state()
    manager = CheckpointManager(tmp_path, [model], optimizer, corrupt_at=lambda s: s == 2)
    manager.save(1, {})
    manager.save(2, {})
    manager.wait()
    assert verify(tmp_path / checkpoint_name(1)) is None
    assert verify(tmp_path / checkpoint_name(2)) is not None


def test_no_checkpoint_gives_step_zero(tmp_path):
    model, optimizer = make_state()
    assert CheckpointManager(tmp_path, [model], optimizer).load_latest() == (0, None, [])


def test_rng_state_round_trips():
    state = rng_state()
    first = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), first)


def test_a_checkpoint_of_another_world_size_gives_rank_0s_job_fields(tmp_path):
    from runtime.checkpoint import load_extra
    for rank in range(2):
        torch.save({"step": 6, "dp_rank": rank, "rng": rng_state(),
                    "global_samples_consumed": 48}, tmp_path / f"extra_rank{rank}.pt")
    assert load_extra(tmp_path, 1, 2)["dp_rank"] == 1                 # same world: its own
    bigger = load_extra(tmp_path, 3, 4)                              # 4 ranks now
    assert bigger["resharded_from"] == 2 and bigger["dp_rank"] == 0
    assert bigger["global_samples_consumed"] == 48


def _resilience(dp: int, global_batch: int = 8):
    from types import SimpleNamespace
    return SimpleNamespace(batches=SimpleNamespace(global_batch=global_batch), dp=dp, rank=0,
                           dp_rank=0, mesh_shape={"pp": 1, "dp": dp, "tp": 1},
                           config=SimpleNamespace(seed=0))


def test_resume_on_another_mesh_reseeds_and_keeps_the_global_position(capsys):
    from runtime.resilience import Resilience, resumed_rng_seed
    extra = {"step": 6, "dp_rank": 0, "rng": {"torch": torch.zeros(1, dtype=torch.uint8)},
             "samples_consumed": 24, "global_samples_consumed": 48, "global_batch": 8,
             "mesh_shape": {"pp": 1, "dp": 2, "tp": 1}, "resharded_from": 2}
    Resilience._restore_position(_resilience(dp=1), 6, extra)
    # the saved (bogus) RNG state is not used: the generator is seeded from (seed, step, rank)
    got = torch.rand(3)
    torch.manual_seed(resumed_rng_seed(0, 6, 0))
    assert torch.equal(got, torch.rand(3))
    assert "continues at global sample 48 (step 6 x global_batch 8)" in capsys.readouterr().out


def test_resume_with_another_global_batch_says_what_to_use():
    from runtime.resilience import Resilience
    extra = {"step": 6, "dp_rank": 0, "rng": rng_state(), "samples_consumed": 24,
             "global_samples_consumed": 48, "global_batch": 8,
             "mesh_shape": {"pp": 1, "dp": 2, "tp": 1}}
    with pytest.raises(RuntimeError, match="global_batch=8; this plan has global_batch=16.*"
                                           "resume with global_batch=8"):
        Resilience._restore_position(_resilience(dp=2, global_batch=16), 6, extra)


def test_optimizer_groups_are_keyed_by_parameter_name(tmp_path):
    # pipeline stages hold different parameters: group-index keys ("param_groups.0.lr") are
    # the same on every stage, so one stage's groups would overwrite another's
    import torch.distributed.checkpoint as dcp
    model, optimizer = make_state()
    train_steps(model, optimizer, 1)
    manager = CheckpointManager(tmp_path, [model], optimizer, asynchronous=False)
    manager.save(1, {})
    manager.wait()
    keys = dcp.FileSystemReader(str(tmp_path / checkpoint_name(1))).read_metadata() \
        .state_dict_metadata
    assert {"optim.param_groups.0.weight.lr", "optim.param_groups.2.bias.betas"} <= set(keys)
    assert "optim.param_groups.0.lr" not in keys


def test_a_checkpoint_with_group_index_keys_still_loads(tmp_path):
    # written the way checkpoints were before the groups were keyed by parameter name
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from runtime.checkpoint import write_manifest
    model, optimizer = make_state()
    train_steps(model, optimizer, 2)
    folder = tmp_path / checkpoint_name(2)
    folder.mkdir()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    torch.save({"step": 2}, folder / "extra_rank0.pt")
    write_manifest(folder, 2)
    expected = train_steps(model, optimizer, 2, start=2)
    fresh, fresh_opt = make_state(seed=1)
    assert CheckpointManager(tmp_path, [fresh], fresh_opt).load_latest()[0] == 2
    assert fresh_opt.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]
    assert train_steps(fresh, fresh_opt, 2, start=2) == expected
