"""Rank searched plans by goodput: the tokens per second that survive failures and stragglers.

For every ranked plan: the job fails at the rate of its ``world_size`` devices (device MTBF,
plus node MTBF per node when given); a checkpoint writes the plan's training state (`checkpoint_bytes`:
the weights in the plan dtype and the Adam states, as `simulator.step.memory` counts them per
stage) and takes the longer of the whole state over the storage bandwidth and the largest
writer's shard over one writer's bandwidth (DCP writes each unique shard once: tp·pp ranks
hold distinct shards, all ranks under ZeRO / FSDP; the first and last pipeline stages hold the
embedding and the output layer, so their writers are the slowest); the checkpoint interval is
Daly's optimum and the goodput the first-order model of
`simulator.failures.goodput.expected_goodput`.
``effective_tokens_per_s`` = tokens/s × goodput, and the table is sorted by it.

A failure costs a restart (``restart_s``: detect, reschedule, reload the checkpoint) plus the
lost work; a node failure (rate: nodes / node MTBF) first waits ``spare_delay_s`` for a spare
node to be swapped in (spares assumed available; `simulator.failures.montecarlo.monte_carlo_goodput`
models a finite pool and repairs), so the mean restart is
``restart_s + (node failures / all failures) · spare_delay_s``.

**Stragglers.** Devices also turn slow without failing (a throttled GPU, a degraded link): at
``straggler_rate_per_device_s`` per device, so a job of N devices meets one at rate · N while
none is open. Each episode is priced with the policy ``meshplan run --on-straggler``
applies (`straggler_episode`, built from `simulator.failures.eviction`): the runtime's
detector confirms it after ``straggler_window`` slow steps, and then the cheaper of

- *stay*: every step until the episode ends (the next failure's restart, which swaps the
  device out: the job MTBF on average, failures being memoryless; with a token budget at most
  half the healthy run, the mean time left from a uniformly placed onset) runs at the slowed
  step (`simulator.failures.montecarlo.straggler_step_time_s`: the critical stage's compute
  ``factor`` times longer);
- *evict*: one stop-and-resume (`restart_estimate_s` of the evidence a planner has: the
  confirming step's checkpoint write (stop), ``restart_s`` (start-up of the relaunch; a
  failure's restart folds its reload into ``restart_s``, an eviction's adds the load of its own
  checkpoint, so a large checkpoint costs more to evict), and that load, the checkpoint read
  as fast as it was written), then the plan on the devices left
  (`evicted_step_s`: the straggler's node goes, and with it every DP replica it held; the
  replicas left share the global batch's micro-batches) until the episode ends;

where the choice is `eviction_pays`, the runtime's rule. The episode's expected cost (seconds of
wall time beyond the healthy steps, `straggler_run_time_s`) times the episode rate
(`straggler_episodes_per_s`) is the fraction of wall time lost: goodput = (failure goodput) ×
max(0, 1 − episodes/s · cost).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from planner.mesh import rank_coords
from planner.spec import DTYPE_BYTES, ModelSpec, Plan, PlanError
from planner.stragglers import STRAGGLER_THRESHOLD, STRAGGLER_WINDOW

# The simulator's modules are imported in the functions that use them: the CLI's --help
# prints this module's defaults and must not load the simulator (tests/apps/test_cli.py).

#: Defaults. Storage: the sustained throughput of the Tectonic file system Llama 3 405B
#: checkpointed to, 2 TB/s (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.1; peak
#: 7 TB/s). One writer: 2 GB/s, a rank's share of its node's storage path (an assumption;
#: `--writer-gbps`). Restart: 300 s from a failure to training again (an assumption;
#: `--restart-s`).
STORAGE_BANDWIDTH_BPS = 2e12
WRITER_BANDWIDTH_BPS = 2e9
RESTART_S = 300.0
#: Llama 3 405B pre-training: 419 unexpected interruptions in a 54-day snapshot on 16,384
#: H100 GPUs (Dubey et al. 2024, §3.3.4, Table 5), i.e. a job MTBF of 54·24/419 = 3.09 h and
#: a per-GPU MTBF of 16,384 × 54·24 / 419 = 50,677 h when every interruption is charged to a GPU.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
DEVICE_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS
#: Straggler episodes per device-hour (slow, not failed, devices). Falcon (T. Wu et al.,
#: "FALCON: Pinpointing and Mitigating Stragglers for Large-Scale Hybrid-Parallel Training",
#: arXiv:2410.12588, 2024; USENIX ATC '25 as "Greyhound"), a study of a production cluster of
#: over 10,000 GPUs, reports fail-slows lasting from tens of seconds to nearly ten hours that
#: delay the average job by 1.34x, but not their rate per device. So the default assumes a device turns slow as often as it fails in
#: Llama 3's run (one per `DEVICE_MTBF_HOURS` device-hours, Dubey et al. 2024, §3.3.4); set
#: ``--straggler-rate`` from your fleet's telemetry.
STRAGGLER_RATE_PER_DEVICE_HOUR = 1.0 / DEVICE_MTBF_HOURS
#: Slowdown of a straggler: the mildest one the runtime's detector confirms, 1 / its relative
#: score threshold (`planner.stragglers.STRAGGLER_THRESHOLD` = 0.7, nvidia-resiliency-ext's
#: ``gpu_relative_perf_threshold``), so 1.43x.
STRAGGLER_FACTOR = 1.0 / STRAGGLER_THRESHOLD
#: Columns `rank_by_goodput` adds to the ranked table (SI units, fractions). ``goodput`` is
#: failures and stragglers together; ``straggler_*`` describe one straggler episode
#: (`StragglerEpisode`).
GOODPUT_COLUMNS = ("goodput", "effective_tokens_per_s", "checkpoint_s", "checkpoint_interval_s",
                   "restart_s", "job_mtbf_s", "failure_goodput", "straggler_loss",
                   "straggler_policy", "straggler_cost_s", "straggler_stay_s",
                   "straggler_evict_s", "straggler_episode_s", "straggler_episodes_per_s",
                   "evict_restart_s",
                   "step_time_slow_s", "step_time_evicted_s")


def checkpoint_writers(plan: Plan) -> int:
    """Ranks that write distinct shards of the state (see the module docstring)."""
    # CP ranks hold the same weights, like DP ranks; ZeRO shards over both (dp·cp).
    return plan.tp * plan.pp * (plan.dp_cp if plan.zero_stage > 0 else 1)


def checkpoint_bytes(model: ModelSpec, plan: Plan) -> tuple[float, float]:
    """(state bytes of the whole job, bytes of the largest writer's shard) of one checkpoint.

    The state is the weights in the plan dtype plus Adam's states (`optimizer_bytes_per_param`:
    fp32 master weights and two moments, 12 bytes, or 8 in fp32 training), per pipeline stage
    from `stage_params` (so a pp > 1 plan also saves its untied output layer copy): a TP rank
    of stage s holds stage_params·(dtype bytes + optimizer bytes); it is the writer unless the
    plan shards over dp·cp (ZeRO / FSDP), which splits it over dp·cp writers.

    >>> from planner.presets import load_model
    >>> m = load_model("tiny-gpt")
    >>> total, largest = checkpoint_bytes(m, Plan(tp=1, pp=1, dp=2, micro_batch=1,
    ...                                           global_batch=8, dtype="fp32"))
    >>> total == largest == m.num_params() * (4 + 8)
    True
    """
    from simulator.step.memory import optimizer_bytes_per_param, stage_params
    per_param = DTYPE_BYTES[plan.dtype] + optimizer_bytes_per_param(plan.dtype)
    shard = checkpoint_writers(plan) // (plan.tp * plan.pp)
    stages = [stage_params(model, plan, s) * per_param for s in range(plan.pp)]
    return sum(stages) * plan.tp, max(stages) / shard


def plan_checkpoint_s(model: ModelSpec, plan: Plan, *,
                      storage_bandwidth_Bps: float = STORAGE_BANDWIDTH_BPS,
                      writer_bandwidth_Bps: float = WRITER_BANDWIDTH_BPS) -> float:
    """Seconds to write one checkpoint of ``plan``: max(state / storage bandwidth, largest
    shard / writer bandwidth) (`checkpoint_bytes`; writers write in parallel, the slowest one
    and the shared storage bound the write).

    Raises:
        PlanError: a non-positive bandwidth.
    """
    if not (storage_bandwidth_Bps > 0 and writer_bandwidth_Bps > 0):
        raise PlanError(f"storage_bandwidth_Bps={storage_bandwidth_Bps} and "
                        f"writer_bandwidth_Bps={writer_bandwidth_Bps} must be > 0")
    total, largest = checkpoint_bytes(model, plan)
    return max(total / storage_bandwidth_Bps, largest / writer_bandwidth_Bps)


def evicted_step_s(plan: Plan, *, step_s: float, compute_s: float, devices_per_node: int,
                   node: int = 0) -> float:
    """Step time (s) of ``plan`` after node ``node`` (its ``devices_per_node`` consecutive ranks,
    numbered as `planner.mesh` numbers them) is left out; ``math.inf`` when no DP replica is
    left whole.

    Every DP replica with a rank on that node goes (its TP and PP peers cannot run without it);
    the ``dp' = dp − lost`` replicas left keep the layout and the global batch, so each runs
    ceil(global_batch / (micro_batch · dp')) micro-batches instead of global_batch /
    (micro_batch · dp). Only the critical stage's compute grows by that ratio (exposed
    communication and the pipeline bubble stay), the closed form of
    `simulator.failures.montecarlo.straggler_step_time_s`. A larger DP group loses a smaller
    share per evicted node.

    >>> p = Plan(tp=1, pp=1, dp=4, micro_batch=1, global_batch=8)
    >>> evicted_step_s(p, step_s=1.0, compute_s=0.8, devices_per_node=1)  # 2 -> 3 micro-batches
    1.4
    >>> evicted_step_s(p, step_s=1.0, compute_s=0.8, devices_per_node=4)
    inf
    """
    # imported here: simulator.failures.montecarlo loads SimPy, and `plan --help` reads this
    # module's defaults
    from simulator.failures.montecarlo import straggler_step_time_s
    first = node * devices_per_node
    ranks = range(first, min(plan.world_size, first + devices_per_node))
    left = plan.dp - len({rank_coords(plan, r)["dp"] for r in ranks})
    if left < 1:
        return math.inf
    before = plan.global_batch / (plan.micro_batch * plan.dp)
    after = math.ceil(plan.global_batch / (plan.micro_batch * left))
    return straggler_step_time_s(step_s, compute_s, after / before)


def eviction_restart_s(checkpoint_s: float, restart_s: float) -> float:
    """Seconds one eviction's stop-and-resume costs a plan whose checkpoint writes in
    ``checkpoint_s``: `simulator.failures.eviction.restart_estimate_s` (the runtime's estimate)
    of the parts a planner knows: stop = the confirming step's checkpoint write, start-up =
    ``restart_s`` (the relaunch), load = that checkpoint read as fast as it was written.

    >>> eviction_restart_s(20.0, 300.0)
    340.0
    """
    from simulator.failures.eviction import RestartEvidence, restart_estimate_s
    evidence = RestartEvidence(stop_s=checkpoint_s, start_up_s=restart_s, load_s=checkpoint_s)
    return restart_estimate_s(evidence)[0]


@dataclass(frozen=True, kw_only=True)
class StragglerEpisode:
    """One straggler episode under the cheaper policy (seconds).

    Attributes:
        steps: healthy steps' worth of work from the onset to the episode's end.
        stay_s / evict_s: wall time beyond ``steps`` healthy steps when staying / evicting
            (``math.inf``: eviction leaves no replica).
        policy: ``"evict"`` when `eviction_pays`, else ``"stay"``.
        cost_s: the chosen policy's cost.
    """

    steps: int
    stay_s: float
    evict_s: float
    policy: str
    cost_s: float


def straggler_episode(*, step_s: float, step_s_slow: float, step_s_evicted: float,
                      episode_s: float, window: int, restart_s: float) -> StragglerEpisode:
    """Cost of a straggler that appears at a step and lasts ``episode_s`` seconds of healthy
    work (``steps`` = round(episode_s / step_s), at least 1): staying runs every step at
    ``step_s_slow``; evicting runs ``window`` slow steps (the detector's confirmation), one
    ``restart_s`` and the rest at ``step_s_evicted`` (`straggler_run_time_s` with onset 1).
    The policy is `eviction_pays` with the steps left after the window, the runtime's rule
    (`runtime.evict.decide_eviction`), which picks the policy with the shorter run.

    >>> e = straggler_episode(step_s=1.0, step_s_slow=3.0, step_s_evicted=2.0,
    ...                       episode_s=10.0, window=3, restart_s=5.0)
    >>> e.stay_s, e.evict_s, e.policy   # 10 x 3 - 10; 3 x 3 + 5 + 7 x 2 - 10
    (20.0, 18.0, 'evict')

    Raises:
        PlanError: a non-positive step time or episode, or a window below 1.
    """
    if not (step_s > 0 and episode_s > 0):
        raise PlanError(f"step_s={step_s} and episode_s={episode_s} must be > 0")
    from simulator.failures.eviction import eviction_pays, straggler_run_time_s
    steps = max(1, round(episode_s / step_s))
    times = {"step_s": step_s, "step_s_staying": step_s_slow, "step_s_after": step_s_evicted,
             "steps": steps, "onset": 1, "window": window, "restart_s": restart_s}
    healthy = steps * step_s
    stay = straggler_run_time_s(**times, evict=False) - healthy
    if math.isinf(step_s_evicted):
        evict, pays = math.inf, False
    else:
        evict = straggler_run_time_s(**times, evict=True) - healthy
        pays = eviction_pays(step_s_staying=step_s_slow, step_s_after=step_s_evicted,
                             steps_left=steps - window, restart_s=restart_s)
    return StragglerEpisode(steps=steps, stay_s=stay, evict_s=evict,
                            policy="evict" if pays else "stay", cost_s=evict if pays else stay)


def straggler_episodes_per_s(onset_rate_per_s: float, episode_s: float) -> float:
    """Straggler episodes per second of a job whose devices turn slow at ``onset_rate_per_s``
    (the devices' rate together) when each episode lasts ``episode_s``: a new one can only
    start once the last one ended, so episodes alternate with the waits for the next onset
    (mean 1 / rate) and the rate is 1 / (1 / rate + episode_s) (an alternating renewal
    process; for rate · episode_s << 1, the first-order rate itself).

    >>> straggler_episodes_per_s(0.5, 2.0)   # 1 / (2 + 2)
    0.25
    >>> straggler_episodes_per_s(0.0, 2.0)
    0.0
    """
    if onset_rate_per_s <= 0:
        return 0.0
    return 1.0 / (1.0 / onset_rate_per_s + episode_s)


def rank_by_goodput(result, model: ModelSpec, *, device_mtbf_s: float,
                    devices_per_node: int = 8, node_mtbf_s: float | None = None,
                    storage_bandwidth_Bps: float = STORAGE_BANDWIDTH_BPS,
                    writer_bandwidth_Bps: float = WRITER_BANDWIDTH_BPS,
                    restart_s: float = RESTART_S, spare_delay_s: float = 0.0,
                    straggler_rate_per_device_s: float = STRAGGLER_RATE_PER_DEVICE_HOUR / 3600,
                    straggler_factor: float = STRAGGLER_FACTOR,
                    straggler_window: int = STRAGGLER_WINDOW,
                    train_tokens: float | None = None, evict_devices: int | None = None):
    """``result`` (a `planner.search.SearchResult`) re-ranked by effective tokens/s.

    Args:
        device_mtbf_s / node_mtbf_s: MTBF of one device and (None: no node failures) of
            one node, seconds.
        storage_bandwidth_Bps / writer_bandwidth_Bps: checkpoint bandwidth of the storage
            and of one writing rank, bytes/s.
        restart_s: seconds from a failure to training again, lost work excluded.
        spare_delay_s: seconds to swap a spare node in after a node failure (module
            docstring); needs ``node_mtbf_s`` to have an effect.
        straggler_rate_per_device_s: straggler episodes per device-second (0: none).
        straggler_factor: a straggler's compute slowdown (>= 1).
        straggler_window: slow steps the runtime's detector takes to confirm one.
        train_tokens: the token budget, if any: an episode lasts at most half the plan's
            healthy run (module docstring).
        evict_devices: devices an eviction leaves out with the straggler (its node; None:
            ``devices_per_node``).

    Adds `GOODPUT_COLUMNS` to ``result.ranked``: ``goodput`` (fraction, failures and
    stragglers), ``effective_tokens_per_s``, ``checkpoint_s`` (write time),
    ``checkpoint_interval_s`` (Daly), ``restart_s`` (mean, spare swaps included),
    ``job_mtbf_s``, ``failure_goodput`` (failures only), ``straggler_loss`` (fraction of wall
    time lost to stragglers), and of one episode: ``straggler_policy``, ``straggler_cost_s``,
    ``straggler_stay_s``, ``straggler_evict_s`` (`StragglerEpisode`), ``straggler_episode_s``
    (its length), ``evict_restart_s`` (`eviction_restart_s`), ``step_time_slow_s`` and
    ``step_time_evicted_s`` (`evicted_step_s`; inf: no replica left).

    Raises:
        PlanError: a non-positive MTBF or bandwidth, a negative restart or spare delay, a
            negative straggler rate, a factor below 1 or a window below 1.
    """
    if restart_s < 0 or spare_delay_s < 0:
        raise PlanError(f"restart_s={restart_s} and spare_delay_s={spare_delay_s} must be >= 0")
    if not (math.isfinite(straggler_rate_per_device_s) and straggler_rate_per_device_s >= 0):
        raise PlanError(f"straggler_rate_per_device_s={straggler_rate_per_device_s} must be "
                        "a finite number >= 0")
    if not (math.isfinite(straggler_factor) and straggler_factor >= 1):
        raise PlanError(f"straggler_factor={straggler_factor} must be a finite number >= 1")
    if straggler_window < 1:
        raise PlanError(f"straggler_window={straggler_window} must be >= 1")
    ranked = result.ranked.copy()
    if ranked.empty:
        return result
    from simulator.failures.goodput import job_goodput
    from simulator.failures.montecarlo import straggler_step_time_s  # SimPy: see evicted_step_s
    rows = []
    row_step = dict(zip(ranked["id"], ranked["step_time_s"], strict=True))
    row_compute = (dict(zip(ranked["id"], ranked["compute_s"], strict=True))
                   if "compute_s" in ranked else {})
    for plan_id, tokens_per_s in zip(ranked["id"], ranked["tokens_per_s"], strict=True):
        plan = result.plans[plan_id]
        write = plan_checkpoint_s(model, plan, storage_bandwidth_Bps=storage_bandwidth_Bps,
                                  writer_bandwidth_Bps=writer_bandwidth_Bps)
        g = job_goodput(tokens_per_s=tokens_per_s, num_devices=plan.world_size,
                        device_mtbf_s=device_mtbf_s, checkpoint_s=write, restart_s=restart_s,
                        devices_per_node=devices_per_node, node_mtbf_s=node_mtbf_s,
                        spare_delay_s=spare_delay_s)
        step_s = float(row_step[plan_id])
        pred = result.predictions.get(plan_id)
        compute_s = pred.compute_s if pred is not None else float(row_compute[plan_id])
        slow = straggler_step_time_s(step_s, compute_s, straggler_factor)
        after = evicted_step_s(plan, step_s=step_s, compute_s=compute_s,
                               devices_per_node=evict_devices or devices_per_node)
        evict_restart = eviction_restart_s(write, restart_s)
        episode_s = g.mtbf_s if train_tokens is None else min(
            g.mtbf_s, train_tokens / tokens_per_s / 2)
        e = straggler_episode(step_s=step_s, step_s_slow=slow, step_s_evicted=after,
                              episode_s=episode_s, window=straggler_window,
                              restart_s=evict_restart)
        episodes = straggler_episodes_per_s(straggler_rate_per_device_s * plan.world_size,
                                            episode_s)
        loss = episodes * e.cost_s
        good = g.goodput * max(0.0, 1.0 - loss)
        rows.append((good, tokens_per_s * good, g.checkpoint_s, g.interval_s,
                     g.restart_s, g.mtbf_s, g.goodput, loss, e.policy, e.cost_s, e.stay_s,
                     e.evict_s, episode_s, episodes, evict_restart, slow, after))
    for i, name in enumerate(GOODPUT_COLUMNS):
        ranked[name] = [row[i] for row in rows]
    ranked = ranked.sort_values(["effective_tokens_per_s", "peak_memory_bytes"],
                                ascending=[False, True], kind="stable").reset_index(drop=True)
    return dataclasses.replace(result, ranked=ranked)


def hours_to_s(hours: float) -> float:
    """MTBF hours to seconds (rejects non-positive values)."""
    if not hours > 0 or math.isinf(hours):
        raise PlanError(f"--mtbf-hours={hours} must be a positive, finite number of hours "
                        f"(default 50677, Llama 3's 419 interruptions in 54 days on 16,384 GPUs)")
    return hours * 3600.0
