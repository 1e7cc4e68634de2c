"""CPU probe: a measured one-core profile plugs into localhost-cpu."""

from runtime.calibrate.probe import measure_cpu_profile
from simulator.network.cluster import load_cluster


def test_measured_profile_is_used_by_localhost_cluster():
    profile = measure_cpu_profile(shapes=[(128, 128, 128), (64, 128, 512)], seconds=0.3)
    # Any CPU core since 2010 does between 1 GFLOP/s and 1 TFLOP/s single-thread fp32.
    assert 1e9 < profile.peak("fp32") < 1e12
    assert 0 < profile.matmul_efficiency <= 1 and profile.memory_bandwidth_Bps > 1e8
    cluster = load_cluster("localhost-cpu", ranks=2, profile=profile)
    assert cluster.device is profile


def test_layer_gemm_shapes_of_llama_with_tp():
    # Llama 3 8B (h=4096, kv=1024, f=14336), tp=2, 8192 tokens: QKV 4096 -> (4096+2048)/2.
    from planner.presets import load_model
    from runtime.calibrate.probe import layer_gemm_shapes
    shapes = layer_gemm_shapes(load_model("llama3-8b"), tp=2)
    assert shapes == [(8192, 4096, 3072), (8192, 2048, 4096), (8192, 4096, 14336),
                      (8192, 7168, 4096)]


def test_probe_times_a_models_layer_shapes():
    from planner.presets import load_model
    profile = measure_cpu_profile(model=load_model("tiny-gpt"), seconds=0.2)
    assert "(128, 256, 768)" in profile.source
