"""The zero-bubble paper's throughput table, simulated: 1F1B, ZB-1p (ZB-H1), ZB-2p (ZB-H2).

Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024), §5: GPT-3-like models (Table
3) trained with Megatron-LM on A100 SXM 80 GB GPUs, one pipeline of p stages (no tensor or
data parallelism), the first and last stages one layer short to balance the embedding and
the loss; Table 4 gives samples per GPU per second. Their ZB-1p and ZB-2p are schedules their
heuristic searches under p and 2p micro-batches of activations; ZB-1p's bubble rates equal
the hand-made ZB-H1's in every setting of their Table 5, so `zb-h1` stands for it. ZB-2p is
simulated as the hand-made ZB-H2 at the same memory (`zb-h2`), whose Table 5 bubble rates lie
above ZB-2p's, so it bounds ZB-2p from below. The zero-bubble runs use the paper's optimizer
post-validation (§4, `SimOptions.optimizer_post_validation`); 1F1B keeps its synchronised
optimizer step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.spec import ModelSpec, Plan
from simulator.network.cluster import load_cluster
from simulator.step.simulate import estimate, simulate
from simulator.validation.frameworks import framework
from simulator.validation.validate import framework_options, megatron_padded_vocab


@dataclass(frozen=True, kw_only=True)
class PaperSetting:
    """One model of Qi et al. 2024 Table 3 and its Table 4 throughputs (samples/GPU/s) per
    micro-batch count, for 1F1B, ZB-1p and ZB-2p."""

    name: str
    layers: int
    heads: int
    hidden: int
    pp: int
    micro_batch: int
    microbatches: tuple[int, ...]
    published: dict[str, tuple[float, ...]]


#: Qi et al. 2024, Table 3 (name, layers, heads, hidden, GPUs = pp, micro-batch size, micro-
#: batch counts; sequence length 1024) and Table 4 (samples per GPU per second of ZB-2p, ZB-1p
#: and 1F1B at those counts).
_TABLES = (
    ("1.5B", 22, 24, 2304, 8, 6, (24, 32, 64), (14.5, 14.8, 14.9), (12.9, 13.4, 14.2),
     (11.8, 12.5, 13.6)),
    ("6.2B", 30, 32, 4096, 8, 3, (24, 32, 64), (4.32, 4.35, 4.39), (3.88, 4.00, 4.20),
     (3.50, 3.70, 4.03)),
    ("14.6B", 46, 40, 5120, 16, 1, (48, 64, 128), (1.81, 1.83, 1.85), (1.61, 1.67, 1.76),
     (1.40, 1.49, 1.64)),
    ("28.3B", 62, 48, 6144, 32, 1, (96, 128, 256), (0.99, 1.00, 1.00), (0.87, 0.90, 0.96),
     (0.76, 0.80, 0.88)),
)
SETTINGS = tuple(
    PaperSetting(name=name, layers=layers, heads=heads, hidden=hidden, pp=pp, micro_batch=mb,
                 microbatches=ms, published={"zb-2p": zb2, "zb-1p": zb1, "1f1b": base})
    for name, layers, heads, hidden, pp, mb, ms, zb2, zb1, base in _TABLES)
SEQ_LEN = 1024
GPT2_VOCAB = 50257


def paper_model(s: PaperSetting) -> ModelSpec:
    """The GPT-3-like model of setting ``s``: 4h MLP, GeLU, LayerNorm, the GPT-2 vocabulary
    padded as Megatron pads it (Brown et al. 2020 §2.1; `megatron_padded_vocab`)."""
    return ModelSpec(name=f"zb-{s.name}", num_layers=s.layers, hidden=s.hidden,
                     num_heads=s.heads, num_kv_heads=s.heads, ffn_hidden=4 * s.hidden,
                     vocab_size=megatron_padded_vocab(GPT2_VOCAB, 1), seq_len=SEQ_LEN,
                     activation="gelu", norm="layernorm")


def stage_layers(s: PaperSetting) -> tuple[int, ...]:
    """Layers per stage: the first and last stages one short of the others (their §5.1)."""
    inner = (s.layers + 2) // s.pp
    return (inner - 1,) + (inner,) * (s.pp - 2) + (inner - 1,)


def simulated_samples_per_gpu_s(s: PaperSetting, m: int, schedule: str, *,
                                fast: bool = False) -> float:
    """Simulated samples per GPU per second of setting ``s`` with ``m`` micro-batches under
    ``schedule`` ("1f1b", "zb-h1" or "zb-h2"): one pipeline of s.pp A100 80 GB GPUs (dgx-a100 nodes;
    HDR InfiniBand in place of their RoCE), fp16, no recomputation, Megatron-LM's options
    (zero-bubble schedules with optimizer post-validation);
    ``fast``: the closed form (`simulator.step.simulate.estimate`) instead of SimPy."""
    cluster = load_cluster("dgx-a100", nodes=max(1, s.pp // 8))
    fw = framework("megatron-lm")
    options = dataclasses.replace(framework_options(fw, dict(fw.defaults), overlap_dp=False),
                                  optimizer_post_validation=schedule != "1f1b")
    plan = Plan(tp=1, pp=s.pp, dp=1, micro_batch=s.micro_batch,
                global_batch=s.micro_batch * m, schedule=schedule, dtype="fp16",
                stage_layers=stage_layers(s))
    step = (estimate if fast else simulate)(paper_model(s), plan, cluster,
                                            options=options).step_time_s
    return s.micro_batch * m / step / s.pp


def zero_bubble_rows(*, fast: bool = False) -> list[dict]:
    """One row per (model, micro-batch count): published and simulated samples/GPU/s of 1F1B,
    ZB-1p and ZB-2p, and whether the simulated 1F1B < ZB-1p < ZB-2p ordering holds."""
    rows = []
    for s in SETTINGS:
        for i, m in enumerate(s.microbatches):
            sim = {k: simulated_samples_per_gpu_s(s, m, k, fast=fast)
                   for k in ("1f1b", "zb-h1", "zb-h2")}
            rows.append({"model": s.name, "gpus": s.pp, "microbatches": m,
                         "published_1f1b": s.published["1f1b"][i],
                         "published_zb1p": s.published["zb-1p"][i],
                         "published_zb2p": s.published["zb-2p"][i],
                         "simulated_1f1b": sim["1f1b"], "simulated_zb1p": sim["zb-h1"],
                         "simulated_zb2p": sim["zb-h2"],
                         "ordering_matches": sim["1f1b"] < sim["zb-h1"] < sim["zb-h2"]})
    return rows
