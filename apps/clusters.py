"""The cluster a command works on, from its flags or from a plan file's cluster block, and the
block a plan file records: one place for both directions.

A localhost cluster is predicted with a calibrated profile only when it is given one:
``--cpu-profile FILE``, by default the newest ``localhost-cpu-*.yaml`` in
``$MESHPLAN_PROFILE_DIR`` (else ``runs/profiles``), ``--cpu-profile none`` for the generic
preset. The profile used is printed with the prediction and written into the plan file, so
``meshplan simulate PLAN`` predicts with the same one unless its ``--cpu-profile`` says otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from planner.precision import storage_dtype, unsupported_dtype_reason
from planner.spec import Plan, PlanError

if TYPE_CHECKING:                   # the simulator loads at command time, not at --help
    from planner.planfile import ClusterRef, PlanFile
    from simulator.network.cluster import Cluster

#: What ``--cpu-profile`` means when it is not given, for a cluster named by flags.
CPU_PROFILE_DEFAULT = ("the newest localhost-cpu-*.yaml in $MESHPLAN_PROFILE_DIR, else "
                       "runs/profiles")


def cpu_profile_help(default: str = CPU_PROFILE_DEFAULT) -> str:
    """The help of ``--cpu-profile`` (and of the explorer's field for it)."""
    return (f"calibrated profile of this machine for localhost clusters (default: {default}; "
            f"'none': the generic CPU preset)")


def add_cpu_profile_option(parser: argparse.ArgumentParser,
                           default: str = CPU_PROFILE_DEFAULT) -> None:
    """Register ``--cpu-profile FILE|none`` on ``parser``; ``default`` says in ``--help``
    what an absent flag means (`cluster_from_flags`, `cluster_of_plan_file`)."""
    parser.add_argument("--cpu-profile", default=None, metavar="FILE|none",
                        help=cpu_profile_help(default))


def resolve_cpu_profile(value: str | None) -> Path | None:
    """The profile file ``--cpu-profile`` names: the file, None for 'none', or (no flag) the
    newest in the default folder (None when there is none).

    Raises:
        PlanError: the named file does not exist.
    """
    from simulator.network.cpu_profile import default_profile_dir, newest_profile
    if value is not None and value.lower() == "none":
        return None
    if value is None:
        return newest_profile(default_profile_dir())
    path = Path(value)
    if not path.is_file():
        raise PlanError(f"--cpu-profile {value!r} does not exist; measure this machine with "
                        f"`meshplan calibrate`, or pass --cpu-profile none")
    return path


def cluster_from_flags(name_or_path: str, nodes: int | None, ranks: int | None,
                       cpu_profile: str | None = None) -> Cluster:
    """The cluster of ``--cluster``, ``--nodes`` / ``--ranks`` and ``--cpu-profile``: a
    localhost cluster takes the flag's profile, else the one its file names, else the newest
    in the default folder.

    Raises:
        PlanError: as `simulator.network.cluster.load_cluster`; a missing profile file; a
            ``--cpu-profile`` for a GPU cluster.
    """
    from simulator.network.cluster import load_cluster
    cluster = load_cluster(name_or_path, nodes=nodes, ranks=ranks)
    if cluster.nics_per_node:
        if cpu_profile is not None:
            raise PlanError(f"--cpu-profile applies only to localhost clusters; "
                            f"{cluster.name!r} is a GPU cluster")
        return cluster
    if cpu_profile is None and cluster.cpu_profile is not None:
        return cluster                          # the cluster file names its own profile
    profile = resolve_cpu_profile(cpu_profile)
    if profile is None:
        return cluster
    return load_cluster(name_or_path, nodes=nodes, ranks=ranks, cpu_profile=profile)


def profile_line(cluster: Cluster) -> str:
    """What a localhost prediction assumes about this machine (the profile it was given)."""
    if cluster.cpu_profile is None:
        return ("assumes the generic CPU preset (no profile of this machine: `meshplan "
                "calibrate` measures it in 3-4 minutes on an idle machine)")
    return f"assumes cpu profile {cluster.cpu_profile.path}"


def cluster_ref(cluster: Cluster, plan: Plan, source: str | None = None) -> ClusterRef:
    """The plan file's block for ``plan`` on ``cluster`` (``source``: the --cluster value,
    recorded as the file's path when it is not a preset)."""
    from planner.planfile import ClusterRef
    from planner.userfile import read_yaml
    from simulator.network.cluster import cluster_names
    localhost = cluster.nics_per_node == 0
    path = spec = None
    if source is not None and source not in cluster_names():
        # the file's contents travel with the plan; its absolute path says where it came from
        path = str(Path(source).resolve())
        spec = read_yaml(source, "cluster")
    profile = cluster.cpu_profile
    return ClusterRef(name=cluster.name, nodes=cluster.num_nodes,
                      ranks=plan.world_size if localhost else None, path=path,
                      cpu_profile=profile.path if profile is not None and profile.path else None,
                      peak_flops_per_device=cluster.device.peak(storage_dtype(plan.dtype)),
                      spec=spec)


def check_plan_on_cluster(pf: PlanFile, cluster: Cluster) -> None:
    """Raise `PlanError` when the plan cannot run on ``cluster``: more ranks than it has
    devices (`simulator.step.costs.check_cluster`), or a dtype its device has no tensor cores
    for (the check a search applies, `planner.precision.unsupported_dtype_reason`). An edited
    plan file must not simulate, export or launch either."""
    from simulator.step.costs import check_cluster
    try:
        check_cluster(pf.plan, cluster)
    except PlanError as exc:
        raise PlanError(f"plan file: {exc}; make a plan for this cluster (`meshplan plan ... "
                        f"--out`)") from None
    reason = unsupported_dtype_reason(pf.plan.dtype, cluster.device.name,
                                      cluster.device.peak_flops)
    if reason:
        raise PlanError(f"plan file: {reason}")


def memory_overrun(pf: PlanFile, cluster: Cluster) -> str | None:
    """None when every pipeline stage of the plan file's plan fits in `MEMORY_HEADROOM` of
    ``cluster``'s device memory (the limit a search applies), else the search's
    out-of-memory reason (`planner.search.out_of_memory_reason`): the worst stage's peak per
    rank, the usable memory, the overrun and the breakdown. An edited plan file can ask for
    more than the device holds; simulate and diff warn, export refuses."""
    from planner.search import out_of_memory_reason
    from planner.spec import MEMORY_HEADROOM
    reason = out_of_memory_reason(pf.model, pf.plan, cluster, MEMORY_HEADROOM)
    return reason or None


def memory_warning(pf: PlanFile, cluster: Cluster, label: str = "") -> str | None:
    """The stderr line of `memory_overrun` for an analysis that still prints its figures."""
    reason = memory_overrun(pf, cluster)
    if reason is None:
        return None
    return (f"warning: {label}{pf.plan.id} does not fit on {cluster.device.name}: {reason}; "
            f"the figures assume it did (a smaller micro_batch, a higher zero_stage or "
            f"recompute fits more; `meshplan plan` finds plans that fit)")


def cluster_of_plan_file(pf: PlanFile, cpu_profile: str | None = None) -> Cluster:
    """The cluster a plan file was made for, with the profile it was predicted with, or the
    one ``cpu_profile`` (a ``--cpu-profile`` value) names instead.

    Raises:
        PlanError: the cluster or its profile file cannot be loaded (the message names it);
            a ``cpu_profile`` for a GPU cluster.
    """
    from simulator.network.cluster import cluster_from_spec, load_cluster
    ref = pf.cluster
    source, nodes = ref.path or ref.name, None if ref.is_localhost else ref.nodes
    ranks = (ref.ranks or pf.plan.world_size) if ref.is_localhost else None
    if ref.spec is not None:
        # the embedded cluster file: the plan simulates where that file is not
        profile = ref.cpu_profile if cpu_profile is None else resolve_cpu_profile(cpu_profile)
        if cpu_profile is not None and ref.spec.get("kind") != "localhost":
            raise PlanError(f"--cpu-profile applies only to localhost clusters; "
                            f"{ref.name!r} is a GPU cluster")
        return cluster_from_spec(ref.name, ref.spec, nodes=nodes, ranks=ranks,
                                 cpu_profile=profile)
    if cpu_profile is not None:
        return cluster_from_flags(source, nodes, ranks, cpu_profile)
    return load_cluster(source, nodes=nodes, ranks=ranks, cpu_profile=ref.cpu_profile)
