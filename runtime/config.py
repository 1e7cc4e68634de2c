"""The runtime's configuration: one frozen, keyword-only `TrainConfig` per training run, checked
on construction. `runtime.train.parse_args` builds it from the command line (argparse only
parses); `meshplan run` (`apps.run_config.check_run_args`) checks its flags through it too.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

from planner.spec import PlanError
from planner.stragglers import STRAGGLER_THRESHOLD, STRAGGLER_WINDOW
from runtime.faults import ON_NAN, fault_flags_error
from runtime.model import ATTENTION_IMPLS


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything `runtime.train` runs besides the plan file's content.

    Attributes:
        plan_path: the plan file (YAML) written by `meshplan plan`.
        out_dir: the run folder (metrics.jsonl, summary.json, plan.yaml, checkpoints/, ...).
        steps: optimizer steps to run (>= 1).
        data: train on the bytes of this file; None: the Python standard library's source.
        seed: seeds the init and the data order.
        attention: the attention kernel: PyTorch SDPA or our tiled FlashAttention-2.
        save_params: ``torch.save`` the full parameters here after the last step (rank 0).
        profile: write a torch profiler Chrome trace per rank into ``out_dir``.
        checkpoint_every: asynchronous checkpoint every K steps (0: none).
        keep: newest checkpoints kept (>= 1).
        checkpoint_dir: where checkpoints go; None: ``out_dir/checkpoints``.
        resume: start from the newest valid checkpoint in this folder (a checkpoint folder, or
            a run folder: its checkpoints/); None: a fresh start.
        inject: fault specs (`runtime.faults`), e.g. ``("kill:rank=1,step=7",)``.
        timeout_s: collective timeout in seconds (a hung rank becomes an error); None: the
            runtime's default.
        on_nan: a NaN loss stops the run with an error, or skips the step's update.
        sync_checkpoint: blocking ``dcp.save`` instead of ``async_save`` (for measurements).
        ep: expert parallel degree of an MoE model (`runtime.parallel.ep`); None: the plan's
            (1 for a plan without one).
        straggler_threshold / straggler_window: a rank whose relative performance score
            stays below the threshold for the window's steps is a straggler
            (`runtime.health`).
        on_straggler: a confirmed straggler is logged ("warn") or evicted ("evict": the
            run checkpoints and stops so that `meshplan run` re-plans without it).
        elastic: the launch is elastic (``torchrun --nnodes MIN:MAX``): a world size other
            than the plan's trains the planner's best plan on the ranks that joined
            (`runtime.evict.plan_for_world`), and a start that finds the job's checkpoints
            continues from them.

    Raises:
        PlanError: a field is out of range; the message names the flag, the value and the
            rule (checks that need the plan file or the world size:
            `runtime.resilience.fault_args_error`).
    """

    plan_path: str
    out_dir: str
    steps: int = 10
    data: str | None = None
    seed: int = 0
    attention: Literal["sdpa", "tiled"] = "sdpa"
    save_params: str | None = None
    profile: bool = False
    checkpoint_every: int = 0
    keep: int = 2
    checkpoint_dir: str | None = None
    resume: str | None = None
    inject: tuple[str, ...] = ()
    timeout_s: float | None = None
    on_nan: Literal["stop", "skip"] = "stop"
    sync_checkpoint: bool = False
    ep: int | None = None
    straggler_threshold: float = STRAGGLER_THRESHOLD
    straggler_window: int = STRAGGLER_WINDOW
    on_straggler: Literal["warn", "evict"] = "warn"
    elastic: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise PlanError(f"--steps={self.steps} must be >= 1")
        if self.attention not in ATTENTION_IMPLS:
            raise PlanError(f"--attention={self.attention!r} is not one of "
                            f"{list(ATTENTION_IMPLS)}")
        if self.on_nan not in ON_NAN:
            raise PlanError(f"--on-nan={self.on_nan!r} is not one of {list(ON_NAN)}")
        if self.ep is not None and (isinstance(self.ep, bool) or not isinstance(self.ep, int)
                                    or self.ep < 1):
            raise PlanError(f"--ep={self.ep!r} must be a positive integer (expert parallel "
                            f"degree)")
        if (problem := fault_flags_error(self)) is not None:
            raise PlanError(problem)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **fields) -> TrainConfig:
        """The config of parsed flags: `runtime.train`'s, or `meshplan run`'s (flags that the
        namespace lacks keep their defaults); ``fields`` override.

        Raises:
            PlanError: as the constructor.
        """
        given = vars(args) | {"plan_path": args.plan, "out_dir": args.out,
                              "inject": tuple(args.inject)} | fields
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in given.items() if name in names})
