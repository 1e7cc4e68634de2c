"""The runtime's block method (`runtime.parallel.recompute.apply_recompute` with
``num_layers``): only the first N blocks of a chunk are checkpointed, and the gradients are those
of the run without recomputation (a single-process reference: the same ops, run again)."""

from __future__ import annotations

from planner.presets import load_model


def test_runtime_wraps_only_the_first_n_blocks_and_keeps_the_gradients():
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from runtime.model import Transformer
    from runtime.parallel.recompute import apply_recompute

    spec = load_model("tiny-gpt")
    torch.manual_seed(0)
    ref = Transformer(spec)
    torch.manual_seed(0)
    part = apply_recompute(Transformer(spec), "full", 1)
    wrapped = [isinstance(b, CheckpointWrapper) for b in part.layers.values()]
    assert wrapped == [True] + [False] * (len(wrapped) - 1)
    tokens = torch.randint(0, spec.vocab_size, (2, 16))
    for m in (ref, part):
        m(tokens).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(ref.named_parameters(), part.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name   # the same ops, recomputed: bitwise equal
