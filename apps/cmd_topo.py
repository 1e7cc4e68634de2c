"""`meshplan topo` (cluster summary, drawing, placement report) and `meshplan collective`
(the simulated counterpart of nccl-tests)."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from apps.clusters import add_cpu_profile_option
from apps.format import (
    CLUSTER_HELP,
    check_at_least,
    check_image_path,
    check_output_path,
    output_file,
    print_json,
    print_table,
    write_csv,
)
from planner.spec import PlanError

if TYPE_CHECKING:
    from rich.console import Console

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
#: Accepted spellings of each collective (nccl-tests names included).
OP_ALIASES = {"all_reduce": ("allreduce", "all-reduce", "all_reduce"),
              "reduce_scatter": ("reducescatter", "reduce-scatter", "reduce_scatter"),
              "all_gather": ("allgather", "all-gather", "all_gather"),
              "all_to_all": ("alltoall", "all-to-all", "all_to_all"),
              "broadcast": ("broadcast", "bcast"),
              "send_recv": ("sendrecv", "send-recv", "send_recv", "p2p")}


def parse_size(text: str) -> int:
    """Bytes of ``'64M'`` (binary units, as nccl-tests reads them: K=2^10, M=2^20, G=2^30).

    >>> parse_size("1M"), parse_size("1G"), parse_size("4096")
    (1048576, 1073741824, 4096)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise PlanError(f"--sizes {text!r} is not a positive size like 1M, 64M, 1G or 4096 "
                        f"(bytes; K, M, G, T in powers of 2)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_op(text: str) -> str:
    """The canonical collective name of ``text`` ('allreduce' -> 'all_reduce')."""
    for name, aliases in OP_ALIASES.items():
        if text.lower() in aliases:
            return name
    raise PlanError(f"collective {text!r} is not one of {list(OP_ALIASES)}")


def _fmt_bw(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _fmt_size(x: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if x >= scale:
            return f"{x / scale:g}{unit}"
    return f"{x:g}"


def _load(args: argparse.Namespace, ranks: int | None):
    from apps.clusters import cluster_from_flags
    return cluster_from_flags(args.cluster, args.nodes, ranks, getattr(args, "cpu_profile", None))


def _print_profile(console: Console, cluster) -> None:
    """The profile a localhost cluster's costs come from (nothing for a GPU cluster)."""
    from apps.clusters import profile_line
    if cluster.nics_per_node == 0:
        console.print(f"  {profile_line(cluster)}", highlight=False)


def collective_rows(cluster, op: str, sizes: list[int], ranks: int | None,
                    algorithm: str = "auto", concurrent: bool = False) -> list[dict]:
    """One nccl-tests-style row per size: time_s, algbw_Bps, busbw_Bps, algorithm."""
    from simulator.network.collectives import collective_cost
    n = cluster.num_devices if ranks is None else ranks
    if not 1 <= n <= cluster.num_devices:
        raise PlanError(f"ranks={n} must be in [1, {cluster.num_devices}] for cluster "
                        f"{cluster.name!r} ({cluster.num_nodes} nodes x "
                        f"{cluster.devices_per_node})")
    if op == "send_recv":
        devices = [0, max(1, n - 1)] if cluster.num_devices > 1 else [0]
        if len(devices) < 2 or devices[1] >= cluster.num_devices:
            raise PlanError("send_recv needs a cluster of at least 2 devices")
    else:
        devices = range(n)
    rows = []
    for size in sizes:
        c = collective_cost(cluster, op, size, devices, concurrent=concurrent,
                            algorithm=algorithm)
        rows.append({"size_bytes": size, "time_s": c.time_s, "algbw_Bps": c.algbw_Bps,
                     "busbw_Bps": c.busbw_Bps, "algorithm": c.algorithm,
                     "protocol": c.protocol})
    return rows


def cmd_collective(args: argparse.Namespace) -> int:
    from rich.console import Console  # here, not at import: `--help` stays fast
    op = parse_op(args.op)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes:
        raise PlanError(f"--sizes {args.sizes!r} lists no size; use e.g. 1M,64M,1G")
    if args.ranks is not None and args.ranks < 2:
        raise PlanError(f"--ranks={args.ranks}: a collective needs at least 2 ranks")
    check_output_path("--csv", args.csv)
    local = args.cluster == "localhost-cpu"
    cluster = _load(args, args.ranks if local else None)
    rows = collective_rows(cluster, op, sizes, None if local else args.ranks,
                           algorithm=args.algorithm, concurrent=args.concurrent)
    if args.concurrent and (args.ranks or cluster.num_devices) >= cluster.num_devices:
        Console(stderr=True).print(
            f"note: --concurrent has no effect here: the group holds all "
            f"{cluster.num_devices} devices, so no other group shares its links (give "
            f"--ranks R below that)", highlight=False, markup=False)
    if args.csv:
        write_csv(rows, args.csv)
    n = args.ranks or cluster.num_devices
    # send_recv honours --ranks as the distance: device 0 sends to device ranks-1
    # (`collective_rows`), so the line names the pair rather than "2 ranks"
    pair = [0, max(1, n - 1)] if op == "send_recv" else None
    if args.json:
        print_json({"op": op, "cluster": cluster.name, "rows": rows,
                    **({"devices": pair} if pair else {"ranks": n})})
        return 0
    import pandas as pd
    console = Console()
    where = f"from device 0 to device {pair[1]}" if pair else f"on {n} ranks"
    console.print(f"[bold]{op}[/] {where} of [bold]{cluster.name}[/] "
                  f"({cluster.num_devices} x {cluster.device.name}); busbw as nccl-tests "
                  f"defines it")
    _print_profile(console, cluster)
    print_table(console, pd.DataFrame(rows), "simulated nccl-tests",
                {"size_bytes": ("size", _fmt_size), "time_s": ("time us",
                                                              lambda t: f"{t * 1e6:.1f}"),
                 "algbw_Bps": ("algbw GB/s", _fmt_bw), "busbw_Bps": ("busbw GB/s", _fmt_bw),
                 "algorithm": ("algorithm", None), "protocol": ("protocol", None)})
    return 0


def _idle_oversubscription(info: dict) -> str:
    """A note when the summary's oversubscription changes nothing: every node sits under one
    leaf (one per rail), so no traffic takes a leaf's uplinks (on a fat-tree not even with
    spines; a rail-optimised fabric with spines still sends cross-rail traffic up)."""
    nodes, rail = info["nodes"], info["topology"] == "rail-optimized"
    if info["oversubscription"] == 1 or nodes > info["nodes_per_leaf"] \
            or (rail and info["tiers"] > 1):
        return ""
    if nodes == 1:
        return " (no effect: one node)"
    return (f" (no effect: one leaf{' per rail' if rail else ''} holds all {nodes} nodes; "
            f"give nodes_per_leaf below {nodes} to spread them)")


def cmd_topo(args: argparse.Namespace) -> int:
    from rich.console import Console  # here, not at import: `--help` stays fast

    from simulator.network.topology import draw_png, summary
    check_image_path("--png", args.png)
    check_at_least("--draw-nodes", args.draw_nodes, hint="servers drawn; default 8")
    if args.draw_nodes is not None and not args.png:
        raise PlanError(f"--draw-nodes {args.draw_nodes} has no effect without --png FILE "
                        f"(it sets how many servers the drawing shows)")
    cluster = _load(args, args.ranks)
    info = summary(cluster)
    out: dict = {"cluster": info}
    if args.plan:
        from planner.planfile import read_plan_file
        from simulator.network.placement import placement_report
        pf = read_plan_file(args.plan)
        plan = pf.plan
        if plan.world_size != cluster.num_devices:
            nodes = -(-plan.world_size // cluster.devices_per_node)
            raise PlanError(
                f"--plan {args.plan}: {plan.id} runs on {plan.world_size} devices, cluster "
                f"{cluster.name!r} has {cluster.num_devices}; give the plan's cluster "
                f"({pf.cluster.name!r}, {pf.cluster.nodes} node(s))"
                + (f" or --nodes {nodes}" if cluster.nics_per_node and
                   plan.world_size % cluster.devices_per_node == 0 else ""))
        if pf.cluster.name != cluster.name:
            Console(stderr=True, soft_wrap=True).print(
                f"note: {plan.id} was made for cluster {pf.cluster.name!r}; its placement is "
                f"shown on {cluster.name!r}", highlight=False, markup=False)
        # The cp ranks of a group sit innermost in the dp axis (Megatron's tp-cp-dp-pp).
        order = [a for axis in plan.placement
                 for a in (("cp", "dp") if axis == "dp" and plan.cp > 1 else (axis,))]
        out["placement"] = {"plan": plan.id, "order": order,
                            "groups": [g.to_dict() for g in placement_report(plan, cluster)]}
    if args.png:
        out["png"] = draw_png(cluster, str(output_file(args.png)), max_nodes=args.draw_nodes or 8)
    if args.json:
        print_json(out)
        return 0
    console = Console()
    where = f"{info['nodes']} {info['node_type']} node(s)" if info["node_type"] else "one machine"
    from rich.markup import escape  # names and errors are text, not markup
    console.print(f"[bold]{escape(info['name'])}[/]: {info['devices']} x {info['device']} on {where}",
                  highlight=False)
    _print_profile(console, cluster)
    intra = info["intra"] + (f", {info['intra_bandwidth_Bps'] / 1e9:g} GB/s per GPU"
                             if info["intra_bandwidth_Bps"] and info["nics_per_node"] else "")
    def _default(key: str) -> str:  # a fabric key the cluster file left to its default
        return " (default)" if f"fabric.{key}" in info.get("defaulted", ()) else ""

    lines = [("intra-node", intra + (", in-switch reduction"
                                     if info["in_switch_reduction"] else ""))]
    if info["nvlink_domain_size"] > 1:
        trays = (f", {info['compute_trays']} compute trays x "
                 f"{info['devices_per_node'] // info['compute_trays']} GPUs"
                 if info["compute_trays"] > 1 else "")
        lines += [("NVLink", f"domain of {info['nvlink_domain_size']} GPUs{trays}; "
                   f"{info['devices'] // info['nvlink_domain_size']} domain(s)")]
    if info["nics_per_node"]:
        lines += [("NICs", f"{info['nics_per_node']} per node x "
                   f"{info['nic_bandwidth_Bps'] * 8 / 1e9:g} Gb/s {info['transport']}"),
                  ("fabric", f"{info['topology']}{_default('topology')}, {info['tiers']} "
                   f"tier(s), radix {info['switch_radix']}, {info['nodes_per_leaf']} nodes "
                   f"per leaf, oversubscription {info['oversubscription']:g}:1"
                   f"{_default('oversubscription')}{_idle_oversubscription(info)}")]
    lines += [("switches", ", ".join(f"{v} {k}" for k, v in info["switches"].items())),
              ("links", f"{info['links']}"),
              ("bisection", f"{info['bisection_bandwidth_Bps'] / 1e9:,.1f} GB/s per "
                            f"direction")]
    for key, value in lines:
        console.print(f"  {key:<11} {value}", highlight=False)
    if args.plan:
        place = out["placement"]
        console.print(f"placement of {place['plan']} (innermost first: "
                      f"{', '.join(place['order'])})")
        import pandas as pd
        df = pd.DataFrame(place["groups"])
        print_table(console, df, "groups per mesh axis",
                    {"axis": ("axis", None), "size": ("size", None),
                     "groups": ("groups", None), "stride": ("device stride", None),
                     "crossing_node": ("cross nodes", None), "max_nodes": ("max nodes", None),
                     "crossing_leaf": ("cross leaves", None)})
    if args.png:
        console.print(f"wrote {args.png}", markup=False)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``topo`` and ``collective`` on the subcommand parser ``sub``."""
    _add_topo_parser(sub)
    _add_collective_parser(sub)


def _add_topo_parser(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("topo", help="summarise and draw a cluster (devices, links, bisection)")
    st.add_argument("cluster", help=CLUSTER_HELP)
    st.add_argument("--nodes", type=int, help="node count (default: the cluster's)")
    st.add_argument("--ranks", type=int, help="processes on localhost-cpu")
    st.add_argument("--png", help="draw the topology to this PNG file")
    st.add_argument("--draw-nodes", type=int, help="servers drawn with --png (default 8)")
    st.add_argument("--plan", help="plan file: report which tp/dp/pp groups cross nodes")
    st.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_cpu_profile_option(st)
    st.set_defaults(func=cmd_topo)


def _add_collective_parser(sub: argparse._SubParsersAction) -> None:
    sc = sub.add_parser("collective", help="simulated nccl-tests: time, algbw, busbw per size")
    sc.add_argument("op", help="all_reduce, reduce_scatter, all_gather, all_to_all, broadcast "
                    "or send_recv (nccl-tests spellings such as allreduce work too)")
    sc.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    sc.add_argument("--nodes", type=int, help="node count (default: the cluster's)")
    sc.add_argument("--ranks", type=int, help="ranks in the group (default: every device; "
                    "send_recv goes from device 0 to device ranks-1)")
    sc.add_argument("--sizes", default="1M,64M,1G", help="comma-separated sizes, binary units "
                    "(default 1M,64M,1G)")
    sc.add_argument("--algorithm", default="auto", help="auto (fastest, as NCCL picks), ring, "
                    "tree, hierarchical, nvls, pairwise or p2p")
    sc.add_argument("--concurrent", action="store_true", help="every same-shaped group of "
                    "the cluster runs at once (shares NICs and uplinks)")
    sc.add_argument("--json", action="store_true", help="print {\"rows\": [...]} on stdout")
    sc.add_argument("--csv", metavar="FILE", help="also write the rows as CSV (SI units)")
    add_cpu_profile_option(sc)
    sc.set_defaults(func=cmd_collective)
