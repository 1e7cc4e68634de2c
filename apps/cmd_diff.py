"""`meshplan diff PLAN_A.yaml PLAN_B.yaml`: two plans side by side, and what makes the
difference.

    meshplan diff a.yaml b.yaml            # table: step time by part, memory by term, groups
    meshplan diff a.yaml b.yaml --json     # the same figures, SI units
"""

from __future__ import annotations

import argparse
import dataclasses

from apps.format import command_console, fmt_gib, fmt_time_s, print_json


def _rows(a, b) -> list[tuple[str, str, float, float]]:
    # (section, name, A, B) of every figure either plan has
    rows = [("step", "step time", a.prediction.step_time_s, b.prediction.step_time_s)]
    for section, attr in (("compute", "compute_by_class_s"), ("exposed comm", "comm_by_kind_s")):
        da, db = getattr(a, attr), getattr(b, attr)
        rows += [(section, k, da.get(k, 0.0), db.get(k, 0.0)) for k in dict.fromkeys([*da, *db])]
    rows.append(("bubble", "bubble", a.prediction.bubble_s, b.prediction.bubble_s))
    rows += [("memory GiB", k, a.memory_bytes[k], b.memory_bytes[k]) for k in a.memory_bytes]
    return rows


def difference_sentence(a, b, rows) -> str:
    """One sentence: which plan is faster, by how much, and the part that moved the most."""
    parts = [r for r in rows if r[0] in ("compute", "exposed comm", "bubble")]
    section, name, va, vb = max(parts, key=lambda r: abs(r[3] - r[2]))
    ta, tb = a.prediction.step_time_s, b.prediction.step_time_s
    faster = "B" if tb < ta else "A"
    gap, slow = abs(ta - tb), max(ta, tb)
    if gap <= 0.005 * slow:
        return f"A and B predict the same step within 0.5% ({fmt_time_s(ta)})."
    what = name if section in ("bubble", name) else f"{section} {name}"
    return (f"{faster} is {fmt_time_s(gap)} per step faster ({gap / slow:.0%}); the largest "
            f"change is {what}: {fmt_time_s(va)} in A, {fmt_time_s(vb)} in B.")


def model_warning(model_a, model_b) -> str | None:
    """None when both plan files train the same model, else the warning line that says how
    they differ (names, or the fields of two models of one name).

    >>> from planner.presets import load_model
    >>> model_warning(load_model("tiny-gpt"), load_model("tiny-gpt")) is None
    True
    >>> model_warning(load_model("llama3-8b"), load_model("llama3-70b"))[:60]
    'warning: A trains llama3-8b, B trains llama3-70b: the step t'
    """
    if model_a == model_b:
        return None
    if model_a.name != model_b.name:
        what = f"A trains {model_a.name}, B trains {model_b.name}"
    else:
        fields = [f.name for f in dataclasses.fields(model_a)
                  if getattr(model_a, f.name) != getattr(model_b, f.name)]
        what = f"A and B both train {model_a.name!r} but its {', '.join(fields)} differ"
    return (f"warning: {what}: the step times compare two different models, not two plans "
            f"of one")


def devices_warning(devices_a: int, devices_b: int) -> str | None:
    """None when both plans run on as many devices, else the warning line that says so.

    >>> devices_warning(16, 16) is None
    True
    >>> devices_warning(128, 32)[:50]
    'warning: A runs on 128 devices, B on 32: the step '
    """
    if devices_a == devices_b:
        return None
    return (f"warning: A runs on {devices_a} devices, B on {devices_b}: the step times "
            f"compare two machine sizes, not two plans on one (compare the MFU rows, or plan "
            f"both on the same cluster and --nodes)")


def cmd_diff(args: argparse.Namespace) -> int:
    from rich.console import Console

    from apps.clusters import cluster_of_plan_file, memory_warning
    from planner.planfile import read_plan_file
    from simulator.step.breakdown import step_breakdown
    console = command_console(args)
    files = [read_plan_file(path) for path in (args.plan_a, args.plan_b)]
    clusters = [cluster_of_plan_file(pf) for pf in files]
    warnings = Console(stderr=True, soft_wrap=True)
    for line in [model_warning(files[0].model, files[1].model),
                 devices_warning(*(c.num_devices for c in clusters)),
                 *(memory_warning(pf, c, f"{label} = ")
                   for label, pf, c in zip("AB", files, clusters, strict=True))]:
        if line is not None:
            warnings.print(line, highlight=False)
    views = [step_breakdown(pf.model, pf.plan, c) for pf, c in zip(files, clusters, strict=True)]
    a, b = views
    rows = _rows(a, b)
    sentence = difference_sentence(a, b, rows)
    if args.json:
        print_json({label: {"id": pf.plan.id, "model": pf.model.name, "cluster": c.name,
                            **view.to_dict()}
                    for label, pf, c, view in zip("ab", files, clusters, views, strict=True)}
                   | {"summary": sentence})
        return 0
    from rich.table import Table
    table = Table(title="\n".join(f"{label} = {pf.plan.id} ({pf.model.name} on {c.name}, "
                                  f"{c.num_devices} devices)"
                                  for label, pf, c in zip("AB", files, clusters, strict=True)))
    for header in ("part", "", "A", "B", "B - A"):
        table.add_column(header, justify="left" if header in ("part", "") else "right")
    for section, name, va, vb in rows:
        fmt = fmt_gib if section == "memory GiB" else fmt_time_s
        delta = fmt(abs(vb - va))
        table.add_row(section, name if name != section else "", fmt(va), fmt(vb),
                      ("-" if vb < va else "+") + delta if vb != va else "")
    for label, v in (("MFU", lambda x: f"{x.prediction.mfu:.1%}"),
                     ("groups across nodes", lambda x: ", ".join(
                         f"{k} ({n} nodes)" for k, n in x.crossing.items()) or "none")):
        table.add_row(label, "", v(a), v(b), "")
    console.print(table)
    console.print(sentence, highlight=False)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``diff`` on the subcommand parser ``sub``."""
    sp = sub.add_parser("diff", help="put two plan files side by side: step time by part, "
                        "memory by term, groups across nodes")
    sp.add_argument("plan_a", metavar="PLAN_A", help="plan file (YAML)")
    sp.add_argument("plan_b", metavar="PLAN_B", help="plan file (YAML)")
    sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    sp.set_defaults(func=cmd_diff)
