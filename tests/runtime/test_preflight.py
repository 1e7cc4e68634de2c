"""Faults from outside that `meshplan run` rejects before any worker starts: one line on stderr,
exit 2, and torchrun never called (so no restart is burnt)."""

from __future__ import annotations

import pytest
import torch

from apps.cli import main
from planner.planfile import ClusterRef, PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan
from runtime.checkpoint import write_manifest


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")


@pytest.fixture
def launches(monkeypatch):
    """The calls of `runtime.launch.run_plan` (none should happen)."""
    import runtime.launch
    calls = []
    summary = {"plan_id": "tp1-pp1-dp2-mb2-gb8", "steps": 7, "final_loss": 3.5,
               "step_time_s": 0.25, "tokens_per_s": 4096.0}
    monkeypatch.setattr(runtime.launch, "run_plan",
                        lambda *a, **k: calls.append(k) or summary)
    return calls


def plan_file(tmp_path, ranks=None, global_batch=8):
    plan = Plan(tp=1, pp=1, dp=2, micro_batch=2, global_batch=global_batch, dtype="fp32")
    cluster = ClusterRef(name="localhost-cpu", nodes=1,
                         ranks=plan.world_size if ranks is None else ranks)
    return write_plan_file(tmp_path / "plan.yaml", PlanFile(
        model=load_model("tiny-gpt").replace(seq_len=32), plan=plan, cluster=cluster))


def checkpoint(folder, step, global_batch=8):
    """A checkpoint folder that verifies (manifest of its files) with rank 0's data position."""
    folder.mkdir(parents=True)
    torch.save({"step": step, "global_batch": global_batch,
                "global_samples_consumed": step * global_batch}, folder / "extra_rank0.pt")
    write_manifest(folder, step)
    return folder


def err_line(capsys) -> str:
    err = capsys.readouterr().err
    return " ".join(err.split())


def test_unwritable_checkpoint_folder_is_named(tmp_path, capsys, launches):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the folder should be")   # root-proof
    assert main(["run", str(plan_file(tmp_path)), "--steps", "4", "--checkpoint-every", "2",
                 "--max-restarts", "3", "--out", str(out)]) == 2
    assert f"checkpoint folder '{out / 'checkpoints'}' cannot be written" in err_line(capsys)
    assert launches == []


def test_resume_whose_every_checkpoint_is_damaged_exits_2(tmp_path, capsys, launches):
    folder = tmp_path / "old" / "checkpoints"
    for step in (2, 4):
        (checkpoint(folder / f"step{step:08d}", step) / "extra_rank0.pt").write_bytes(b"x")
    assert main(["run", str(plan_file(tmp_path)), "--steps", "6", "--resume", str(folder),
                 "--out", str(tmp_path / "run")]) == 2
    err = err_line(capsys)
    assert "every checkpoint is damaged" in err and "step00000004" in err \
        and "step00000002" in err
    assert launches == []


def test_resume_with_another_global_batch_exits_2(tmp_path, capsys, launches):
    folder = tmp_path / "old" / "checkpoints"
    checkpoint(folder / "step00000002", 2, global_batch=16)
    assert main(["run", str(plan_file(tmp_path)), "--steps", "6", "--resume", str(folder),
                 "--out", str(tmp_path / "run")]) == 2
    assert "was trained with global_batch=16, this plan has global_batch=8" in err_line(capsys)
    assert launches == []


def test_data_shorter_than_one_sequence_exits_2(tmp_path, capsys, launches):
    data = tmp_path / "short.txt"
    data.write_bytes(b"x" * 20)            # seq_len 32 needs 33 bytes
    assert main(["run", str(plan_file(tmp_path)), "--steps", "2", "--data", str(data),
                 "--out", str(tmp_path / "run")]) == 2
    assert "has 20 bytes, fewer than one sequence needs (seq_len + 1 = 33)" in err_line(capsys)
    assert launches == []


def test_cluster_block_that_disagrees_with_the_world_size_exits_2(tmp_path, capsys, launches):
    assert main(["run", str(plan_file(tmp_path, ranks=4)), "--steps", "2",
                 "--out", str(tmp_path / "run")]) == 2
    assert "has ranks=4, but plan" in err_line(capsys)
    assert launches == []


@pytest.mark.parametrize("every, step", [(3, 4), (0, 3)], ids=["off-interval", "no-checkpoints"])
def test_corrupting_a_step_that_never_checkpoints_exits_2(tmp_path, capsys, launches, every,
                                                          step):
    assert main(["run", str(plan_file(tmp_path)), "--steps", "8", "--checkpoint-every",
                 str(every), "--inject", f"corrupt-checkpoint:step={step}",
                 "--out", str(tmp_path / "run")]) == 2
    assert f"step {step} writes no checkpoint" in err_line(capsys)
    assert launches == []


def test_corrupting_the_last_step_is_accepted(tmp_path, launches):
    # the last step always checkpoints (runtime.resilience.Resilience.after_step)
    assert main(["run", str(plan_file(tmp_path)), "--steps", "7", "--checkpoint-every", "3",
                 "--inject", "corrupt-checkpoint:step=7", "--out", str(tmp_path / "run")]) == 0
    assert len(launches) == 1
