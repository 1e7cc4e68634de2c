"""Single-process reference training: the same model, data and optimizer with no distribution.

Tests compare every distributed run against it, and ``meshplan compare`` uses it to check that a
plan trains the same model. It is independent of `runtime.parallelize` and `runtime.parallel`:
one process, the whole global batch in one forward and backward, no micro-batches, no DTensor,
no process group.
"""

from __future__ import annotations

import os

import torch

from planner.spec import ModelSpec, Plan
from runtime.data import ByteBatches, read_corpus
from runtime.model import Transformer, cross_entropy_loss
from runtime.train import make_optimizer


def reference_losses(model_spec: ModelSpec, plan: Plan, steps: int,
                     data: str | os.PathLike | None = None, seed: int = 0) -> list[float]:
    """The losses of `reference_run` (see there)."""
    return reference_run(model_spec, plan, steps, data, seed)[0]


def reference_run(model_spec: ModelSpec, plan: Plan, steps: int,
                  data: str | os.PathLike | None = None, seed: int = 0
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``steps`` steps in one process (fp32); return each step's loss and the parameters.

    Uses ``plan.global_batch`` only: every step trains on the same global batch a distributed
    run of ``plan`` sees (`runtime.data.ByteBatches`), as one (B, T) batch.

    Args:
        model_spec: the model.
        plan: supplies the global batch.
        steps: optimizer steps.
        data: text file to train on; None for the standard-library corpus.
        seed: seeds the init and the data order (as ``runtime.train --seed``).
    Returns:
        (mean cross-entropy (nats per token) over each step's global batch, before that step's
        update; ``{name: tensor}`` of the parameters after the last update, named as
        ``Transformer.named_parameters`` and as ``runtime.train --save-params`` writes them).
    Raises:
        FileNotFoundError / ValueError: ``data`` is missing or shorter than one sequence.
    """
    model = Transformer(model_spec, seed=seed)
    optimizer = make_optimizer(model.parameters())
    batches = ByteBatches(read_corpus(data, model_spec.seq_len), seq_len=model_spec.seq_len,
                          global_batch=plan.global_batch, seed=seed)
    losses = []
    for k in range(steps):
        inputs, targets = batches.global_batch_at(k)            # (B, T), (B, T)
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(model(inputs), targets)       # logits (B, T, V) -> scalar
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}
