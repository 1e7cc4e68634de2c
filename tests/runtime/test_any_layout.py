"""Resume onto any layout: a checkpoint written by one of dp2 / tp2 / pp2 / pp2-interleaved /
pp2 x dp2 loads on every other one (DCP reshards; the keys do not depend on pipeline chunks).

Each source layout trains the 4-layer tiny-gpt for 6 steps with a checkpoint after step 4; a
target layout resumes from that checkpoint and trains steps 5 and 6. Its losses must match the
source's own steps 5 and 6: the same model state, data and update on another split of the
work. The layouts sum the loss in another order, so the match is to fp32 rounding (rel 1e-4),
not bitwise (a wrong or missing tensor after a resume moves the loss by far more: a fresh
model's loss differs in the first digit).
"""

from __future__ import annotations

import shutil

import pytest

from runtime.checkpoint import chunk_free_key
from runtime.launch import run_plan

LAYOUTS = {
    "dp2": {"dp": 2},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "pp2-interleaved": {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2},
    "pp2xdp2": {"pp": 2, "dp": 2},
}
STEPS, AT = 6, 4


@pytest.fixture(scope="module")
def layout_plan(write_plan, tiny_plan, tiny_model):
    return lambda name: write_plan(f"layout-{name}", tiny_plan(**LAYOUTS[name]),
                                   tiny_model(num_layers=4))


@pytest.fixture(scope="module")
def source_run(layout_plan, tmp_path_factory):
    """name -> (losses of an uninterrupted 6-step run, folder holding its step-4 checkpoint)."""
    runs = {}

    def run(name):
        if name not in runs:
            out = tmp_path_factory.mktemp(f"src-{name}")
            summary = run_plan(layout_plan(name), steps=STEPS, out_dir=out, quiet=True,
                               checkpoint_every=AT, timeout_s=150)
            kept = out / "at-step4"
            kept.mkdir()
            shutil.copytree(out / "checkpoints" / f"step{AT:08d}", kept / f"step{AT:08d}")
            runs[name] = (summary["losses"], kept)
        return runs[name]
    return run


def check_pair(source, target, layout_plan, source_run, tmp_path) -> None:
    losses, checkpoint = source_run(source)
    summary = run_plan(layout_plan(target), steps=STEPS, out_dir=tmp_path, quiet=True,
                       resume=checkpoint, timeout_s=150)
    assert summary["steps"] == STEPS - AT            # a new job: only the steps it ran
    assert summary["losses"] == pytest.approx(losses[AT:], rel=1e-4)


@pytest.mark.parametrize(("source", "target"), [("pp2-interleaved", "dp2"),
                                                ("dp2", "pp2-interleaved")])
def test_interleaved_checkpoints_load_on_another_layout_and_back(
        source, target, layout_plan, source_run, tmp_path):
    check_pair(source, target, layout_plan, source_run, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("source", list(LAYOUTS))
@pytest.mark.parametrize("target", list(LAYOUTS))
def test_every_layout_pair(source, target, layout_plan, source_run, tmp_path):
    if source == target:
        pytest.skip("same layout: covered by the restart tests")
    check_pair(source, target, layout_plan, source_run, tmp_path)


def test_chunk_index_is_dropped_from_model_and_optimizer_keys():
    # a rank with chunks [0, 2] of an interleaved pp2 names layer 3 "1.layers.3..." in its
    # ModuleList; one-chunk layouts name it "layers.3..."
    assert chunk_free_key("1.layers.3.mlp.fc.weight") == "layers.3.mlp.fc.weight"
    assert chunk_free_key("state.1.layers.3.mlp.fc.weight.exp_avg") == \
        "state.layers.3.mlp.fc.weight.exp_avg"
    assert chunk_free_key("layers.3.mlp.fc.weight") == "layers.3.mlp.fc.weight"
