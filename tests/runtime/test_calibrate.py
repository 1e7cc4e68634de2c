"""`meshplan calibrate` and the calibrated localhost-cpu path: profiles are found, read and
used, GPU clusters are untouched, and a real (tiny) calibration writes a usable profile."""

import os

import pytest
import yaml

from planner.presets import load_model
from planner.spec import Plan
from runtime.calibrate.calibrate import (
    _collective_fit,
    _fit_alpha_beta,
    _slowest_rank,
    calibrate,
    write_profile,
)
from simulator.network.cluster import load_cluster
from simulator.network.cpu_profile import (
    at_size,
    default_profile_dir,
    newest_profile,
    read_profile,
    shape_key,
)
from simulator.step.costs import stage_costs
from simulator.step.cpu_model import cpu_stage_costs
from simulator.step.simulate import simulate

TINY = load_model("tiny-gpt")


def _terms(scale: float) -> dict:
    per = {128: 0.01 * scale, 1024: 0.08 * scale}
    return {"layer_fwd": per, "layer_bwd": {t: 2 * v for t, v in per.items()},
            "layer_bwd_full": {t: 3 * v for t, v in per.items()},
            "edge_fwd": per, "edge_bwd": per, "emb_fwd": {128: 1e-4, 1024: 8e-4},
            "emb_bwd": {128: 1e-4, 1024: 8e-4}, "opt_layer_s": 0.002, "opt_edge_s": 0.001}


def synthetic_profile(stamp: str = "20260101T000000") -> dict:
    """A profile mapping in `write_profile`'s format with made-up, self-consistent numbers."""
    fit = {"latency_s": 1e-3, "bandwidth_Bps": 1e9}
    coll = {op: {"n2": fit, "n4": fit} for op in ("all_reduce", "reduce_scatter", "all_gather")}
    return {"schema": "meshplan-cpu-profile/1", "created_utc": stamp, "threads_per_rank": 1,
            "machine": {"cores": 2}, "calibration": {"seconds": 1.0},
            "device": {f"localhost-cpu-core-{stamp}": {
                "peak_flops": {"fp32": 1.0e11}, "memory_bytes": 4.0e9,
                "memory_bandwidth_Bps": 1.0e10, "matmul_efficiency": 0.5,
                "memory_efficiency": 1.0, "source": "synthetic"}},
            "cpu_costs": {"compute": {shape_key(TINY): {
                "local": {1: _terms(1.0), 2: _terms(1.1), 4: _terms(2.2)},
                "tp": {"tp2": {2: _terms(0.7), 4: _terms(1.4)}}}},
                "collectives": {2: {**coll, "p2p": fit}, 4: {**coll, "p2p": fit}}}}


def test_newest_profile_is_the_latest_timestamp(tmp_path):
    assert newest_profile(tmp_path) is None
    write_profile(synthetic_profile("20260101T000000"), tmp_path / "localhost-cpu-20260101T000000.yaml")
    newer = write_profile(synthetic_profile("20260102T000000"))  # $MESHPLAN_PROFILE_DIR
    write_profile(synthetic_profile("20260103T000000"), newer.parent / "localhost-cpu-20260103T000000.yaml")
    assert newer.parent == default_profile_dir()
    assert newest_profile(default_profile_dir()).name == "localhost-cpu-20260103T000000.yaml"
    assert newest_profile(tmp_path).name == "localhost-cpu-20260101T000000.yaml"


def test_profile_round_trips_with_a_preset_format_device(tmp_path):
    path = write_profile(synthetic_profile(), tmp_path / "p.yaml")
    data = yaml.safe_load(path.read_text())
    (name, device), = data["device"].items()
    assert set(device) == {"peak_flops", "memory_bytes", "memory_bandwidth_Bps",
                           "matmul_efficiency", "memory_efficiency", "source"}
    profile = read_profile(path)
    assert profile.device.name == name and profile.covers(TINY)
    assert profile.collective_s("all_reduce", 1e6, 2, 2) == pytest.approx(1e-3 + 1e-3)
    assert profile.collective_s("all_reduce", 1e6, 1, 1) == 0.0


def test_localhost_cpu_uses_the_profile_it_is_given_and_names_it():
    path = write_profile(synthetic_profile())
    # no hidden input: a profile in the default folder is not picked up unless given
    assert load_cluster("localhost-cpu", ranks=2).cpu_profile is None
    cluster = load_cluster("localhost-cpu", ranks=2, cpu_profile=path)
    assert cluster.cpu_profile.name == path.stem and path.stem in cluster.source
    assert cluster.device.peak("fp32") == 1.0e11


def test_calibrated_costs_replace_the_generic_model_only_on_localhost():
    plan = Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="fp32")
    generic = stage_costs(TINY, plan, load_cluster("localhost-cpu", ranks=1))
    gpu_before = simulate(TINY, plan.replace(dtype="bf16"), load_cluster("dgx-h100")).step_time_s
    path = write_profile(synthetic_profile())
    calibrated = stage_costs(TINY, plan, load_cluster("localhost-cpu", ranks=1,
                                                      cpu_profile=path))[0]
    # 4 layers x 10 ms + embedding + head (edge 10 ms - embedding 0.1 ms)
    assert calibrated.fwd_compute_s == pytest.approx(4 * 0.01 + 1e-4 + (0.01 - 1e-4))
    assert calibrated.fwd_compute_s != generic[0].fwd_compute_s
    assert simulate(TINY, plan.replace(dtype="bf16"),
                    load_cluster("dgx-h100")).step_time_s == gpu_before
    # an uncalibrated shape falls back to the generic per-op model
    wide = TINY.replace(hidden=512, num_heads=8, num_kv_heads=8)
    assert stage_costs(wide, plan, load_cluster("localhost-cpu", ranks=1, cpu_profile=path))


def test_oversubscribed_pipeline_runs_at_its_average_busy_rank_count():
    cluster = load_cluster("localhost-cpu", ranks=4, cpu_profile=write_profile(synthetic_profile()))
    pp4 = Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=8, dtype="fp32")
    dp4 = Plan(tp=1, pp=1, dp=4, micro_batch=1, global_batch=8, dtype="fp32")
    layer_pp = stage_costs(TINY, pp4, cluster)[1].fwd_compute_s
    layer_dp = stage_costs(TINY, dp4, cluster)[0]
    # pp4 with 8 micro-batches keeps 4·8/11 = 2.9 ranks busy: between the 2- and 4-process
    # speeds; dp4 keeps all 4 busy (2.2x the 1-process time)
    assert 0.011 < layer_pp < 0.022
    assert layer_dp.fwd_compute_s == pytest.approx(2.2 * (4 * 0.01 + 0.01))


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    pts = [(s, 2e-4 + s / 2e9) for s in (4e3, 6.4e4, 1e6, 4e6)]
    fit = _fit_alpha_beta(pts)
    assert fit["latency_s"] == pytest.approx(2e-4, rel=1e-6)
    assert fit["bandwidth_Bps"] == pytest.approx(2e9, rel=1e-6)


def test_collective_time_interpolates_the_measured_points():
    # gloo all-reduce over 4 ranks on 2 cores as measured (rounded): 7 ms up to 1 MiB (every
    # ring hop waits for a core), 29 ms at 16 MiB; no alpha-beta line fits both ends
    points = {4096: 0.007, 2**20: 0.007, 16 * 2**20: 0.029}
    assert at_size(points, 16) == 0.007                        # below the smallest: its time
    assert at_size(points, 2**19) == pytest.approx(0.007)
    # halfway between 1 MiB and 16 MiB in bytes: halfway in time (linear interpolation)
    assert at_size(points, 8.5 * 2**20) == pytest.approx(0.018)
    # beyond 16 MiB: the line through the two largest points, 22 ms per 15 MiB
    assert at_size(points, 31 * 2**20) == pytest.approx(0.051)


def test_profiles_with_points_use_them_and_older_ones_the_fit(tmp_path):
    mapping = synthetic_profile()
    fit_4 = mapping["cpu_costs"]["collectives"][4]
    fit_4["all_reduce"] = {"n4": {"latency_s": 1e-3, "bandwidth_Bps": 1e9,
                                  "points": {4096: 0.007, 16 * 2**20: 0.029}}}
    profile = read_profile(write_profile(mapping, tmp_path / "p.yaml"))
    assert profile.collective_s("all_reduce", 64, 4, 4) == pytest.approx(0.007)
    # the 2-rank fit has no points: alpha-beta, 1 ms + 1 MB / (1 GB/s)
    assert profile.collective_s("all_reduce", 1e6, 2, 2) == pytest.approx(2e-3)


def test_collective_points_never_decrease_with_size():
    # a dip (1 MiB measured faster than 4 KiB) is noise: pooled with its neighbour
    fit = _collective_fit([(4096, 0.007), (2**20, 0.003), (16 * 2**20, 0.029)])
    assert fit["points"] == {4096: 0.005, 2**20: 0.005, 16 * 2**20: 0.029}
    assert {"latency_s", "bandwidth_Bps"} <= set(fit)


def test_processes_timed_together_keep_the_slowest_of_each_step():
    # two processes, three steps of (fwd, bwd, opt): step 1 rank 0 is slower, steps 2-3 rank 1
    rank0 = [(2.0, 4.0, 1.0), (1.0, 2.0, 1.0), (1.0, 2.0, 1.0)]
    rank1 = [(1.0, 2.0, 1.0), (3.0, 3.0, 1.0), (1.0, 3.0, 1.0)]
    # slowest per step: (2, 4, 1), (3, 3, 1), (1, 3, 1); medians of each phase
    assert _slowest_rank([rank0, rank1]) == {"fwd": 2.0, "bwd": 3.0, "opt": 1.0}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores for two ranks")
@pytest.mark.slow  # ~1-1.5 min of torchrun groups; the profile format and its use are covered above
def test_tiny_calibration_writes_a_profile_the_simulator_uses(tmp_path):
    micro = TINY.replace(name="micro", hidden=64, num_heads=2, num_kv_heads=2,
                         ffn_hidden=128, seq_len=32)
    seen = []
    mapping = calibrate([micro], ranks=2, micro_batches=(1, 2), tp_micro_batches=(1,),
                        iters=1, progress=lambda what, frac: seen.append(frac))
    assert seen and sum(seen) == pytest.approx(1.0)
    path = write_profile(mapping)
    profile = read_profile(path)
    local = profile.compute[shape_key(micro)]["local"]
    assert set(local) == {1, 2} and set(profile.compute[shape_key(micro)]["tp"]) == {"tp2"}
    assert set(profile.collectives[2]) >= {"all_reduce", "reduce_scatter", "all_gather", "p2p"}
    points = profile.collectives[2]["all_reduce"]["n2"]["points"]
    assert sorted(points) == [4096, 65536, 2**20, 4 * 2**20, 16 * 2**20]
    assert list(points.values()) == sorted(points.values())
    pred = simulate(micro, Plan(tp=2, pp=1, dp=1, micro_batch=1, global_batch=2, dtype="fp32"),
                    load_cluster("localhost-cpu", ranks=2, cpu_profile=path))
    assert pred.step_time_s > 0
    # the cp = 2 layers are measured on the ring (the tiled kernel) and a cp plan uses them
    assert set(profile.compute[shape_key(micro)]["cp"]) == {"cp2"}
    cp_plan = Plan(tp=1, cp=2, pp=1, dp=1, micro_batch=1, global_batch=2, dtype="fp32")
    cluster = load_cluster("localhost-cpu", ranks=2, cpu_profile=path)
    assert cpu_stage_costs(micro, cp_plan, cluster) is not None
    assert simulate(micro, cp_plan, cluster).step_time_s > 0
