"""Evict and continue: leave a confirmed straggler's node out, re-plan, resume on the new layout.

Under ``meshplan run --on-straggler evict`` the workers stop after the step that confirmed a
straggler (`runtime.health`), with a checkpoint of that step (`runtime.resilience`), and wait.
`runtime.launch.run_plan` asks this module what to do (`decide_eviction`, `decide_in_flight`)
and publishes the answer in the run folder; the ranks that stay form the smaller group in
their own processes and resume from that checkpoint on the new plan (`role_after`,
`join_smaller_group`; no new process, so no start-up and no import is paid again), the others
leave. A spare node needs new processes: then every rank leaves and the job is relaunched
(`finish_launch`).

1. **Which ranks remain.** On one machine a "node" is a group of ``ranks_per_node``
   consecutive ranks (rank r sits on node r // K, as torchrun numbers a multi-node job). Every
   node that holds a straggler goes; a spare node, while there are ``spares`` left, takes a
   bad node's place (its ranks keep their numbers, the world size stays).
2. **The new plan.** The planner searches every legal plan of the same model and global batch
   on each world size from the ranks that remain down to 1 (a world size whose cores are
   shared is a different cluster, so each is searched on its own), and the fastest predicted
   one wins (`planner.search.search`); the global batch stays, so the data position continues
   (step k trains on samples [k·B, (k+1)·B) on any layout).
3. **What it costs.** Staying costs the straggler's slowdown on every step left; leaving
   costs one restart (`simulator.failures.eviction.eviction_pays`, the same rule the goodput
   model uses). The old plan's step time with the straggler comes from the simulator's
   straggler model (`simulator.step.simulate.estimate` with ``stragglers``), with the
   measured slowdown (compute over the peers' median, the inverse of the relative score).
   The restart is predicted from what this job measured of itself
   (`runtime.accounting.restart_evidence`: the stop so far, its own launch's start-up, a
   checkpoint load), by `simulator.failures.eviction.restart_estimate_s`.

The decision is logged as one line (`decision_line`) and kept in summary.json
(``evictions``): what was seen, old plan → new plan, the predicted step time before and after.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from planner.planfile import ClusterRef, PlanFile, read_plan_file, write_plan_file
from planner.spec import PlanError
from runtime.faults import parse_faults


@dataclass(frozen=True, kw_only=True)
class Eviction:
    """One eviction decision (all times in seconds).

    Attributes:
        seen: the confirmed stragglers (`runtime.health.StragglerDetector.observe` records).
        step: the step the job stopped after (its checkpoint).
        bad_nodes: nodes left out (or swapped for spares).
        kept_ranks: old rank of each new rank (None: a spare's rank).
        spares_used: spare nodes swapped in.
        old_plan / new_plan: plan ids; equal when a spare took the bad node's place.
        predicted_step_s_before: the old plan with the straggler (simulator's straggler model).
        predicted_step_s_after: the new plan on the ranks that remain.
        pays: whether leaving is predicted to save time over the steps left (the job leaves
            either way: ``--on-straggler evict`` asks for it; the line says what it costs).
        reason: the arithmetic of ``pays``.
        restart_s / restart_basis: the predicted restart and what it rests on
            (`simulator.failures.eviction.restart_estimate_s`).
        in_place: the ranks that stay resume in their own processes (`role_after`); False
            when a spare's new processes join (the job is relaunched).
    """

    seen: list[dict]
    step: int
    bad_nodes: list[int]
    kept_ranks: list[int | None]
    spares_used: int
    old_plan: str
    new_plan: str
    predicted_step_s_before: float
    predicted_step_s_after: float
    pays: bool
    reason: str
    restart_s: float
    restart_basis: str
    in_place: bool
    new_world: int = field(default=0)

    def to_dict(self) -> dict:
        return asdict(self)


def surviving_ranks(world: int, bad_ranks: list[int], *, ranks_per_node: int = 1,
                    spares: int = 0) -> tuple[list[int | None], list[int], int]:
    """(old rank of each new rank (None: a spare's), bad nodes, spares used).

    >>> surviving_ranks(4, [1], ranks_per_node=1)
    ([0, 2, 3], [1], 0)
    >>> surviving_ranks(4, [1], ranks_per_node=2)
    ([2, 3], [0], 0)
    >>> surviving_ranks(4, [1], ranks_per_node=2, spares=1)
    ([None, None, 2, 3], [0], 1)

    Raises:
        PlanError: ``ranks_per_node`` does not divide ``world``, or a rank is out of range.
    """
    if ranks_per_node < 1 or world % ranks_per_node:
        raise PlanError(f"--ranks-per-node={ranks_per_node} must divide the world size "
                        f"{world}; use one of "
                        f"{[k for k in range(1, world + 1) if world % k == 0]}")
    if any(not 0 <= r < world for r in bad_ranks):
        raise PlanError(f"straggler ranks {bad_ranks} are not all in [0, {world})")
    bad_nodes = sorted({r // ranks_per_node for r in bad_ranks})
    swapped = set(bad_nodes[:max(0, spares)])
    kept: list[int | None] = []
    for rank in range(world):
        node = rank // ranks_per_node
        if node in swapped:
            kept.append(None)
        elif node not in bad_nodes:
            kept.append(rank)
    return kept, bad_nodes, len(swapped)


def remap_faults(specs: list[str], kept: list[int | None]) -> list[str]:
    """The injected faults that still apply after an eviction, renumbered to the new ranks:
    a fault of a rank that left (or whose place a spare took) is gone with its device.

    >>> remap_faults(["slow:rank=1,factor=3", "kill:rank=3,step=9"], [0, 2, 3])
    ['kill:rank=2,step=9']
    """
    out = []
    for fault in parse_faults(specs):
        if fault.rank is None:
            out.append(fault.spec)
        elif fault.rank in kept:
            out.append(replace(fault, rank=kept.index(fault.rank)).spec)
    return out


def cluster_at(ref: ClusterRef, world: int, plan_world: int):
    """``ref``'s cluster with ``world`` devices, and its plan-file block, or None when the
    world does not fill whole nodes: a localhost cluster of ``world`` ranks (whose cores are
    shared, so each world size is a different cluster), or ``world`` / (devices per node) nodes
    of a GPU cluster, its devices per node being ``plan_world`` / ``ref.nodes``."""
    from simulator.network.cluster import cluster_from_spec, load_cluster

    def load(**size):
        if ref.spec is not None:                   # the cluster file embedded in the plan file
            return cluster_from_spec(ref.name, ref.spec, cpu_profile=ref.cpu_profile, **size)
        return load_cluster(ref.path or ref.name, cpu_profile=ref.cpu_profile, **size)
    if ref.is_localhost:
        return load(ranks=world), replace(ref, ranks=world)
    per_node = max(1, plan_world // ref.nodes)
    if world % per_node:
        return None
    return load(nodes=world // per_node), replace(ref, nodes=world // per_node)


def best_plan_at(pf: PlanFile, world: int) -> tuple[PlanFile, float] | None:
    """The fastest predicted plan file of ``pf``'s model and global batch on exactly
    ``world`` devices of ``pf``'s cluster (`cluster_at`), and its predicted step time (s);
    None when no plan is legal there (`planner.search.search`)."""
    # imported here: the ranks import this module for the wait (next_layout), not the planner
    from planner.search import search
    from planner.space import SearchSpace

    found = cluster_at(pf.cluster, world, pf.plan.world_size)
    if found is None:
        return None
    cluster, ref = found
    result = search(pf.model, cluster, global_batch=pf.plan.global_batch, num_devices=world,
                    dtype=pf.plan.dtype, space=SearchSpace(cp=(1,)), top_k=3, explain=False)
    if result.ranked.empty:
        return None
    plan = result.plans[result.ranked.iloc[0]["id"]]
    pred = result.predictions[plan.id]
    return (PlanFile(model=pf.model, plan=plan, prediction=pred.to_dict(), cluster=ref),
            pred.step_time_s)


def best_plan_on(pf: PlanFile, max_world: int) -> tuple[PlanFile, float]:
    """The fastest predicted plan file of ``pf``'s model and global batch on at most
    ``max_world`` ranks of ``pf``'s localhost cluster (`best_plan_at` on each world size),
    and its predicted step time (s).

    Raises:
        PlanError: no legal plan on any world size up to ``max_world``.
    """
    best = None
    for world in range(max_world, 0, -1):
        found = best_plan_at(pf, world)
        if found is not None and (best is None or found[1] < best[1]):
            best = found
    if best is None:
        raise PlanError(f"no legal plan of {pf.model.name} with global_batch="
                        f"{pf.plan.global_batch} on 1 to {max_world} ranks")
    return best


def plan_for_world(pf: PlanFile, world: int) -> PlanFile:
    """The plan file an elastic launch (``torchrun --nnodes MIN:MAX``) trains when ``world``
    ranks joined: ``pf`` itself when its world size is ``world``, else the planner's best plan
    of the same model and global batch on exactly ``world`` ranks (`best_plan_at`); the
    global batch stays, so the data position continues on the new layout.

    Raises:
        PlanError: no legal plan on ``world`` ranks (the message names the world size).
    """
    if world == pf.plan.world_size:
        return pf
    found = best_plan_at(pf, world)
    if found is None:
        raise PlanError(f"no plan of {pf.model.name} with global_batch="
                        f"{pf.plan.global_batch} runs on {world} devices, and an elastic "
                        "launch (--nnodes MIN:MAX) needs one on every node count of its "
                        "range: `meshplan launch --nodes N --min-nodes M` names the "
                        "--min-nodes whose range has a plan on every node count")
    return found[0]


def straggler_step_s(pf: PlanFile, seen: list[dict]) -> float:
    """Predicted step time of ``pf``'s plan with the ``seen`` stragglers at their measured
    slowdown (compute time over the peers' median); ``seen=[]``: healthy."""
    from simulator.network.cluster import load_cluster
    from simulator.step.simulate import estimate
    ref = pf.cluster
    cluster = load_cluster(ref.path or ref.name, ranks=pf.plan.world_size,
                           cpu_profile=ref.cpu_profile)
    factors = {s["rank"]: max(1.0, s["compute_time_s"] / s["peers_median_s"]) for s in seen}
    return estimate(pf.model, pf.plan, cluster, stragglers=factors or None).step_time_s


def decide_eviction(plan_path: str | Path, evicted: dict, *, steps: int, ranks_per_node: int,
                    spares: int, events: list[dict] = (), launched_unix_s: float | None = None,
                    clock=time.time) -> tuple[Eviction, PlanFile]:
    """What to do about the stragglers of ``evicted`` (summary.json's ``evicted``: step,
    ranks, stragglers) of the job running ``plan_path`` for ``steps`` steps (module
    docstring). Returns the decision and the plan file to resume with.

    Args:
        events: the job's event log (`runtime.accounting.read_events`), its evidence of what
            a restart costs; none: `simulator.failures.eviction.LOCAL_RESTART_S`.
        launched_unix_s: when the launch that ran the job's latest attempts started.
        clock: the time now (unix s), read after the re-planning, which the stop includes.
    """
    from runtime.accounting import restart_evidence
    from simulator.failures.eviction import eviction_pays, restart_estimate_s
    pf = read_plan_file(plan_path)
    world = pf.plan.world_size
    kept, bad_nodes, used = surviving_ranks(world, evicted["ranks"],
                                            ranks_per_node=ranks_per_node, spares=spares)
    before = straggler_step_s(pf, evicted["stragglers"])
    if used and len(kept) == world:            # spares took every bad node's place
        new_pf, after = pf, straggler_step_s(pf, [])
    elif not kept:
        raise PlanError(f"every node holds a straggler (ranks {evicted['ranks']}, "
                        f"--ranks-per-node {ranks_per_node}); nothing is left to resume on")
    else:
        new_pf, after = best_plan_on(pf, len(kept))
    left = steps - evicted["step"]
    in_place = not used
    restart_s, basis = restart_estimate_s(restart_evidence(
        list(events), launched_unix_s=launched_unix_s, now_unix_s=clock()) if events else None,
        in_place=in_place)
    pays = eviction_pays(step_s_staying=before, step_s_after=after, steps_left=left,
                         restart_s=restart_s)
    reason = (f"{left} steps left x ({before:.3f} - {after:.3f}) s = "
              f"{left * (before - after):.1f} s saved "
              f"{'>' if pays else '<='} restart {restart_s:.1f} s")
    decision = Eviction(seen=evicted["stragglers"], step=evicted["step"], bad_nodes=bad_nodes,
                        kept_ranks=kept, spares_used=used, old_plan=pf.plan.id,
                        new_plan=new_pf.plan.id, predicted_step_s_before=before,
                        predicted_step_s_after=after, pays=pays, reason=reason,
                        restart_s=restart_s, restart_basis=basis, in_place=in_place,
                        new_world=new_pf.plan.world_size)
    return decision, new_pf


def decision_line(d: Eviction) -> str:
    """``meshplan evict: rank 1 (score 0.33) on node 1 ... tp1-pp1-dp4 -> ...``."""
    seen = ", ".join(f"rank {s['rank']} (relative score {s['score']:.2f})" for s in d.seen)
    verb = f"swapped {d.spares_used} spare node(s) in for" if d.spares_used else "left out"
    return (f"meshplan evict: after step {d.step} saw {seen}; {verb} node(s) {d.bad_nodes} "
            f"({len(d.kept_ranks)} ranks left); plan {d.old_plan} -> {d.new_plan}; predicted "
            f"step {d.predicted_step_s_before:.3f} s with the straggler -> "
            f"{d.predicted_step_s_after:.3f} s ({d.reason}; restart: {d.restart_basis})")


def write_evicted_plan(out: Path, number: int, pf: PlanFile) -> Path:
    """Write the plan file a job resumes with after its ``number``-th eviction."""
    return write_plan_file(Path(out) / f"plan-evict{number}.yaml", pf)


#: The line rank 0 prints once a stopped job's checkpoint landed and its summary is written;
#: `meshplan run` decides on it while the ranks wait (`decide_in_flight`).
STOPPED_PREFIX = "meshplan evict: stopped after step"
#: Seconds the stopped ranks wait for the decision before they leave (no launcher is left).
DECISION_TIMEOUT_S = 600.0


def eviction_number(events: list[dict]) -> int:
    """The job-wide number of the newest eviction: its "evict" events so far (a relaunched or
    resumed job goes on counting, so a decision file is never read twice)."""
    return sum(e["event"] == "evict" for e in events)


def decision_path(out: str | Path, number: int) -> Path:
    """``OUT/faults/evict{number}.json``: the decision on the job's ``number``-th eviction."""
    return Path(out) / "faults" / f"evict{number}.json"


def publish_decision(out: str | Path, number: int, record: dict) -> None:
    """Write the decision file whole or not at all (the ranks poll for it)."""
    path = decision_path(out, number)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def await_decision(out: str | Path, number: int, *, stopped=lambda: False,
                   timeout_s: float = DECISION_TIMEOUT_S, poll_s: float = 0.02) -> dict | None:
    """The decision on eviction ``number``, once `meshplan run` published it; None when
    ``stopped()`` (a stop signal) or after ``timeout_s`` without one."""
    path = decision_path(out, number)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if stopped() or time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
    return json.loads(path.read_text())


def role_after(decision: dict, rank: int) -> int | None:
    """This process's rank in the smaller group that ``decision`` resumes on in place, or
    None when it leaves (its node was evicted, the new plan needs fewer ranks, or the job is
    relaunched on new processes).

    >>> role_after({"in_place": True, "kept_ranks": [0, 2, 3], "new_world": 2}, 2)
    1
    >>> role_after({"in_place": True, "kept_ranks": [0, 2, 3], "new_world": 2}, 3) is None
    True
    """
    if decision.get("error") or not decision.get("in_place"):
        return None
    stay = decision["kept_ranks"][:decision["new_world"]]
    return stay.index(rank) if rank in stay else None


def join_smaller_group(rank: int, world: int, number: int) -> None:
    """Make this process rank ``rank`` of ``world`` for the layout of eviction ``number``.

    torchrun's environment is where every part of the runtime reads its rank and world size
    (and `runtime.train.init_distributed` its rendezvous prefix), so the smaller group is
    this process with that environment rewritten; the agent's store stays the rendezvous.
    """
    # LOCAL_RANK stays: it names this process's device on its node, which does not move
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MESHPLAN_LAYOUT=str(number))


def next_layout(config, *, stopped=lambda: False):
    """After a run stopped for an eviction (`runtime.train.train` returned it): announce the
    stop (rank 0, `STOPPED_PREFIX`), wait for the decision, and return this process's
    `runtime.config.TrainConfig` for the smaller group (the new plan, resumed from the job's
    checkpoints, its faults renumbered), or None when it leaves (`role_after`).

    Args:
        stopped: true once a stop signal arrived (the wait ends, the process leaves).
    """
    from runtime.accounting import read_events
    out = Path(config.out_dir)
    events = read_events(out)
    number, rank = eviction_number(events), int(os.environ.get("RANK", "0"))
    if rank == 0:
        step = next(e["step"] for e in reversed(events) if e["event"] == "evict")
        print(f"{STOPPED_PREFIX} {step} (eviction {number}); waiting for the new plan",
              flush=True)
    decision = await_decision(out, number, stopped=stopped)
    role = None if decision is None else role_after(decision, rank)
    if role is None:
        return None
    join_smaller_group(role, decision["new_world"], number)
    return replace(config, plan_path=decision["plan_file"],
                   resume=config.checkpoint_dir or str(out / "checkpoints"),
                   inject=tuple(decision["inject"]))


def decide_in_flight(plan_path, *, out: Path, steps: int, inject: list[str], spares: int,
                     ranks_per_node: int, launched_unix_s: float | None = None,
                     quiet: bool = False) -> dict:
    """Decide on the stragglers that stopped the job (its ``summary.json``'s ``evicted``),
    log the decision and publish it to the waiting ranks (`publish_decision`); returns the
    decision record kept in summary.json's ``evictions``.

    With no spare to swap in, the ranks that stay resume in place on the new plan (no new
    processes, `role_after`); a spare needs new processes, so every rank leaves and
    `finish_launch` relaunches the job. The restart estimate is this job's own evidence in
    ``out``'s event log, with ``launched_unix_s`` the start of the running launch.

    Raises:
        PlanError: nothing is left to resume on. On this or any other error the ranks are
            told to leave first, so none waits for a decision that will not come.
    """
    from runtime.accounting import read_events
    events = read_events(out)
    number = eviction_number(events)
    try:
        evicted = json.loads((Path(out) / "summary.json").read_text())["evicted"]
        decision, new_pf = decide_eviction(plan_path, evicted, steps=steps,
                                           ranks_per_node=ranks_per_node, spares=spares,
                                           events=events, launched_unix_s=launched_unix_s)
    except Exception as exc:
        publish_decision(out, number, {"error": str(exc)})
        raise
    line = decision_line(decision)
    if not quiet:
        print(line, flush=True)
    same = new_pf.plan.id == read_plan_file(plan_path).plan.id and decision.spares_used
    new_path = plan_path if same else write_evicted_plan(out, number, new_pf)
    kept = decision.kept_ranks[:decision.new_world]
    record = decision.to_dict() | {"line": line, "plan_file": str(new_path),
                                   "inject": remap_faults(inject, kept),
                                   "spares_left": spares - decision.spares_used}
    publish_decision(out, number, record)
    return record


def finish_launch(summary: dict, evictions: list[dict], *, out: Path, relaunch) -> dict:
    """The whole job's summary after a launch that evicted: when its newest decision needs
    new processes (a spare), the job goes on through ``relaunch(plan_path, nproc, inject,
    spares_left)``; ``evictions`` lists every decision of the job, in order."""
    last = evictions[-1]
    if not last["in_place"]:
        final = relaunch(last["plan_file"], last["new_world"], last["inject"],
                         last["spares_left"])
        # the relaunch's own evictions (a later straggler) come after these
        final["evictions"] = evictions + (final.get("evictions") or [])
    else:
        final = summary | {"evictions": evictions}
    (out / "summary.json").write_text(json.dumps(final, indent=2) + "\n")
    return final
