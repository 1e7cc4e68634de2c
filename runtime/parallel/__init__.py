"""One module per parallelism technique, each built on torch.distributed's own blocks:
`tp` (DTensor tensor parallelism), `pp` (pipelining, tied embeddings across stages), `dp`
(DDP / FSDP2, gradient sync for accumulation) and `recompute` (activation recomputation).
`runtime.parallelize` composes them for a plan.
"""
