"""Reading a file the user names: a model, plan or cluster YAML file, or a runs CSV.

Every loader reads through here, so that a missing path, a folder, a file that is not UTF-8
text, a YAML syntax error (named by file, line and column), an empty file and a file of the
wrong kind (a plan file given as a model, ...) get the same one-line `PlanError`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from planner.spec import ModelSpec, PlanError

_CLUSTER = ("a cluster file holds kind: gpu (with node_type, nodes, nic, fabric) or kind: "
            "localhost, as docs/clusters.md shows")
_PLAN = "write one with `meshplan plan ... --out plan.yaml`"
#: Per kind of meshplan file, the tails of its errors: (empty or not a mapping, wrong kind).
KIND_HINTS = {
    "model": ("write ModelSpec fields, e.g. 'num_layers: 32', 'hidden: 4096', 'num_heads: 32', "
              "one per line (the README's custom model example lists them)",
              "(a model file has ModelSpec fields: num_layers, hidden, num_heads, ...); give a "
              "model preset or a model YAML file"),
    "plan": (_PLAN, f"(a plan file has schema_version, model, plan and cluster); {_PLAN}"),
    "cluster": (_CLUSTER, f"({_CLUSTER}); give a cluster preset or such a file"),
}


def read_text(path: str | Path, what: str) -> str:
    """The text of the user's file ``path`` (``what``: how messages name it, e.g. 'model
    file', '--runs').

    Raises:
        PlanError: the path does not exist, is a folder, or is not UTF-8 text.
    """
    path = Path(path)
    if path.is_dir():
        raise PlanError(f"{what} {str(path)!r} is a folder; give a file")
    if not path.is_file():
        raise PlanError(f"{what} {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8-sig")   # a leading BOM (Excel's CSVs) dropped
    except UnicodeDecodeError as exc:
        raise PlanError(f"{what} {str(path)!r} is not UTF-8 text (byte {exc.start} is "
                        f"0x{exc.object[exc.start]:02x}); save it as UTF-8") from None


def file_kind(data: object) -> str | None:
    """'plan', 'cluster' or 'model': the kind of meshplan file a YAML mapping's top-level keys
    say it is; None when they say none of these.

    >>> file_kind({"schema_version": 1, "plan": {}}), file_kind({"kind": "gpu"})
    ('plan', 'cluster')
    >>> file_kind({"num_layers": 2, "hidden": 64}), file_kind({"x": 1}), file_kind([1])
    ('model', None, None)
    """
    if not isinstance(data, dict):
        return None
    if "plan" in data or "schema_version" in data:
        return "plan"
    if "kind" in data or "node_type" in data or "nic" in data:
        return "cluster"
    model_keys = {f.name for f in dataclasses.fields(ModelSpec)}
    return "model" if model_keys & set(data) else None


def read_yaml(path: str | Path, kind: str, also: tuple[str, ...] = ()) -> dict:
    """The mapping in the user's ``kind`` ('model', 'plan' or 'cluster') YAML file ``path``
    (``also``: other kinds accepted in its place, e.g. a plan file for its model).

    Raises:
        PlanError: as `read_text`; the YAML is malformed (the message names the file, line
            and column), the file is empty or holds no mapping, or its top-level keys are
            those of another kind of file (`file_kind`).
    """
    return parse_yaml(read_text(path, f"{kind} file"), repr(str(path)), kind, also)


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (the YAML 1.2 spec
    requires keys to be unique; PyYAML keeps the last value without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"has the key {key!r} twice (lines {seen[key] + 1} and "
                                    f"{key_node.start_mark.line + 1})")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, name: str, kind: str, also: tuple[str, ...] = ()) -> dict:
    """The mapping in ``text``, the contents of a ``kind`` file called ``name`` in messages
    (a quoted path, or e.g. 'uploaded'); checks and errors as `read_yaml`."""
    how, wrong = KIND_HINTS[kind]
    label = f"{kind} file {name}"
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise PlanError(f"{label} {exc}; keep one (YAML would keep the last silently)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise PlanError(f"{label} is not valid YAML{where}: {problem}") from None
    if data is None:
        raise PlanError(f"{label} is empty; {how}")
    if not isinstance(data, dict):
        raise PlanError(f"{label} holds a YAML {type(data).__name__}, not a mapping; {how}")
    found = file_kind(data)
    if found is not None and found != kind and found not in also:
        raise PlanError(f"{label} looks like a {found} file, not a {kind} file {wrong}")
    return data
