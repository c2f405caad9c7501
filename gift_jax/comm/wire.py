"""Wire accounting: bytes moved by a compiled function's collectives, read from its HLO.

Bus-bytes model, per device, for a collective over a group of ``P`` devices whose full-size
buffer is ``S`` bytes:

=================== ======================== ===========================================
collective          S                        bytes on the wire per device
=================== ======================== ===========================================
all-reduce          its operand/result       ``2(P−1)/P · S``
reduce-scatter      its operand (= P·result) ``(P−1)/P · S``
all-to-all          all its operands         ``(P−1)/P · S``
all-gather          its result               ``(P−1)/P · S``
collective-permute  its operand              ``S``
=================== ======================== ===========================================

The dtypes are those XLA really uses: e.g. on this JAX a collective of float8 arrays is
lowered as f16 — which is why the quantized all-reduce bitcasts to ``uint8`` first, and why a
claim like "FP8 moves a quarter of fp32's bytes" is checked here rather than assumed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

#: The HLO collectives, by opcode (an async pair adds ``-start``/``-done``).
COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-to-all", "all-gather",
                    "collective-permute")
_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>all-reduce|reduce-scatter|all-to-all|all-gather|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b(?P<dtype>pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|"
                    r"f8e4m3fn|f8e4m3|f8e5m2|f8e4m3fnuz|f8e5m2fnuz|f8e8m0fnu|f4e2m1fn|c64|c128)"
                    r"\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
         "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
         "f8e4m3fn": 8, "f8e4m3": 8, "f8e5m2": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8,
         "f8e8m0fnu": 8, "f4e2m1fn": 4, "c64": 64, "c128": 128}
_GROUPS_LIST = re.compile(r"replica_groups=\{\{(?P<first>[\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<n>\d+),(?P<size>\d+)\]<=\[(?P<dims>[\d,]+)\]"
                          r"(?:T\((?P<perm>[\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
                          r"(?:, device_ids=\((?P<ids>[^ ]*)\))? \{(?P<names>[^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{")
#: An async start's type that holds its operands as a tuple first (XLA:GPU prints
#: ``((u8[64,128]), u8[64,128])``): the results follow.
_OPERANDS_FIRST = re.compile(r"\s*\(\s*\([^()]*\)\s*,\s*(?P<results>.*)\)\s*$")
_FIRST_PAIR = re.compile(r"source_target_pairs=\{\{(?P<first>\d+,\d+)\}")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective in the HLO."""

    kind: str  # all-reduce | reduce-scatter | all-to-all | all-gather | collective-permute
    dtypes: tuple[str, ...]  # element types of the arrays it moves
    group_size: int  # P
    buffer_bytes: int  # S (see the module docstring)
    wire_bytes: float  # per device and step, bus-bytes model, times ``executions``
    group: tuple[int, ...] = ()  # the device ids of one of its groups (() = unknown)
    axes: tuple[str, ...] = ()  # the mesh axes its groups span (with a mesh given to parse_hlo)
    executions: int = 1  # per step: the trip counts of the loops around it (a scanned layer's)


@dataclasses.dataclass(frozen=True)
class WireReport:
    """All collectives of a compiled function and their bytes per device.

    The aggregates are properties (``report.total``, ``report.by_kind``,
    ``report.by_dtype``); what takes arguments or renders is a method (``report.over(axes)``,
    ``report.within(axes)``, ``report.table()``).
    """

    ops: tuple[CollectiveOp, ...]

    @property
    def total(self) -> float:
        """Wire bytes per device of all the collectives."""
        return float(sum(op.wire_bytes for op in self.ops))

    @property
    def by_kind(self) -> dict[str, float]:
        """Wire bytes per device by collective kind (``{"all-reduce": ..., ...}``)."""
        out: dict[str, float] = {}
        for op in self.ops:
            out[op.kind] = out.get(op.kind, 0.0) + op.wire_bytes
        return out

    @property
    def by_dtype(self) -> dict[str, float]:
        """Wire bytes per device by the dtypes a collective carries (``"f32"``, ``"u8"``;
        several joined by ``+``)."""
        out: dict[str, float] = {}
        for op in self.ops:
            key = "+".join(sorted(set(op.dtypes)))
            out[key] = out.get(key, 0.0) + op.wire_bytes
        return out

    def over(self, axes: str | tuple[str, ...]) -> WireReport:
        """The collectives whose groups span any of the mesh ``axes`` (needs a report parsed
        with a mesh).

        Args:
          axes: a mesh axis name or a tuple of them.

        Returns:
          A :class:`WireReport` of those collectives (empty for a report parsed without a mesh,
          whose collectives name no axes).
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        return WireReport(tuple(op for op in self.ops if set(op.axes) & set(axes)))

    def within(self, axes: str | tuple[str, ...]) -> WireReport:
        """The collectives whose groups span only mesh axes among ``axes``.

        Args:
          axes: a mesh axis name or a tuple of them.

        Returns:
          A :class:`WireReport` of those collectives; collectives that name no axes (a report
          parsed without a mesh, or a group of one device) are left out.
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        return WireReport(tuple(op for op in self.ops if op.axes and set(op.axes) <= set(axes)))

    def table(self) -> str:
        """A Markdown table of the collectives (kind, dtype, group size, bytes), with a total
        row."""
        lines = ["| collective | dtype | P | S bytes | wire bytes/device |",
                 "|---|---|---|---|---|"]
        for op in self.ops:
            lines.append(f"| {op.kind} | {'+'.join(sorted(set(op.dtypes)))} | {op.group_size} "
                         f"| {op.buffer_bytes} | {op.wire_bytes:.0f} |")
        lines.append(f"| total | | | | {self.total:.0f} |")
        return "\n".join(lines)


def array_bytes(type_str: str) -> list[tuple[str, int]]:
    """``[(dtype, bytes)]`` of every array in an HLO type string (``(u8[4,128], u32[])``).

    Args:
      type_str: the result type of an HLO instruction: one array type or a tuple of them.

    Returns:
      ``(HLO dtype name, size in bytes)`` per array, in order (sub-byte types rounded down to
      whole bytes; a scalar counts one element).
    """
    out = []
    for m in _ARRAY.finditer(type_str):
        dims = [int(d) for d in m.group("dims").split(",") if d]
        nbits = _BITS[m.group("dtype")] * int(np.prod(dims, dtype=np.int64))
        out.append((m.group("dtype"), nbits // 8))
    return out


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _mesh_group(line: str) -> tuple[int, ...] | None:
    """The first group of ``replica_groups=mesh['a'=2,…], device_ids=([4,2]T(1,0)) {'a'}``
    (newer XLA): the devices that differ only along the named axes of that mesh."""
    m = _GROUPS_MESH.search(line)
    if not m:
        return None
    axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group("axes"))]
    ids = np.arange(int(np.prod([n for _, n in axes])))
    if m.group("ids"):
        iota = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group("ids"))
        ids = _iota([int(d) for d in iota.group(1).split(",")],
                    [int(p) for p in iota.group(2).split(",")] if iota.group(2) else None)
    ids = ids.reshape([n for _, n in axes])
    names = set(re.findall(r"'([^']+)'", m.group("names")))
    index = tuple(slice(None) if a in names else 0 for a, _ in axes)
    return tuple(int(i) for i in ids[index].reshape(-1))


def _first_group(line: str, num_devices: int) -> tuple[int, ...]:
    """The device ids of the first replica group (a collective-permute: its first pair)."""
    group = _mesh_group(line)
    if group is not None:
        return group
    m = _GROUPS_IOTA.search(line)
    if m:
        ids = _iota([int(d) for d in m.group("dims").split(",")],
                    [int(p) for p in m.group("perm").split(",")] if m.group("perm") else None)
        return tuple(int(i) for i in ids.reshape(int(m.group("n")), int(m.group("size")))[0])
    m = _GROUPS_LIST.search(line) or _FIRST_PAIR.search(line)
    if m and m.group("first"):
        return tuple(int(i) for i in m.group("first").split(","))
    return tuple(range(num_devices))


def _axes_of(group: tuple[int, ...], mesh) -> tuple[str, ...]:
    """The mesh axes along which the devices of ``group`` (positions in the mesh's device
    order, as the compiled module numbers them) differ."""
    coords = np.array([np.unravel_index(i, mesh.devices.shape) for i in group])
    return tuple(name for k, name in enumerate(mesh.axis_names)
                 if len(set(coords[:, k].tolist())) > 1)


def parse_hlo(hlo_text: str, num_devices: int | None = None, mesh=None) -> WireReport:
    """:class:`WireReport` of an HLO module's text (``compiled.as_text()``); with the
    ``mesh`` the function was compiled for, every collective also names the mesh axes its
    groups span (:meth:`WireReport.over`).

    Args:
      hlo_text: the text of an HLO module.
      num_devices: the number of devices the module runs on (replica groups without explicit
        members span them), or ``None`` to infer it.
      mesh: the mesh the function was compiled for, or ``None``.

    Returns:
      The :class:`WireReport`.
    """
    if mesh is not None:
        num_devices = mesh.devices.size
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    ops = []
    comps, _ = computations(hlo_text)
    runs = executions(hlo_text)
    for comp, line in ((c, x) for c, lines in comps.items() for x in lines):
        m = _LINE.match(line)
        if not m:
            continue
        kind, type_str = m.group("op"), m.group("type")
        nested = _OPERANDS_FIRST.match(type_str) if m.group("start") else None
        if nested:  # XLA:GPU's async starts: ((operands), results): count the results once
            type_str = nested.group("results")
        arrays = array_bytes(type_str)
        if m.group("start"):  # the TPU compiler's async starts also carry u32[] sync scalars
            arrays = [a for a, shape in zip(arrays, _ARRAY.finditer(type_str),
                                            strict=True) if shape.group("dims")]
        if (m.group("start") and not nested and kind in ("all-gather", "collective-permute")
                and len(arrays) > 1):
            # async start ops return (operands, results): keep the results for all-gather,
            # the operand for collective-permute
            half = len(arrays) // 2
            arrays = arrays[half:] if kind == "all-gather" else arrays[:half]
        group = _first_group(line, num_devices)
        P = 2 if _PAIRS.search(line) else len(group)
        total = sum(b for _, b in arrays)
        dtypes = tuple(d for d, _ in arrays)
        if kind == "all-reduce":
            S, wire = total, 2 * (P - 1) / P * total
        elif kind == "reduce-scatter":
            S = total * P
            wire = (P - 1) / P * S
        elif kind == "collective-permute":
            S, wire = total, float(total)
        else:  # all-to-all, all-gather
            S, wire = total, (P - 1) / P * total
        if P <= 1:
            wire = 0.0
        axes = _axes_of(group, mesh) if mesh is not None else ()
        n = runs.get(comp, 1)
        ops.append(CollectiveOp(kind, dtypes, P, S, wire * n, group, axes, n))
    return WireReport(tuple(ops))


_HEAD = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"\b(?P<how>calls|body|condition|to_apply|branch_computations|"
                     r"called_computations)=\{?(?P<names>%?[\w.\-]+(?:,\s*%[\w.\-]+)*)\}?")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONSTANT = re.compile(r"constant\((\d+)\)")
#: One instruction of printed HLO: its name, result type, opcode, operands and attributes
#: (the trip counter here and :mod:`gift_jax.apps.pod_estimate`'s schedule replay read it).
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(?P<name>%[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
                         r"(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)(?P<attrs>.*)$")


def loop_trips(while_line: str, condition: Sequence[str], body: Sequence[str] = (),
               caller: Sequence[str] = ()) -> int:
    """A while loop's trip count: XLA's ``known_trip_count`` where the backend config has it,
    else from its condition ``counter < N`` (against one constant; the TPU compiler's
    scheduled HLO drops the annotation), the counter's step in ``body`` (its root tuple's
    element at the counter's index is ``counter + k``) and its start in ``caller`` (the
    loop's initial tuple holds a constant ``s`` there, or a copy of one):
    ``⌈(N − s) / k⌉``. The TPU compiler's windowed einsums step by 2 (two chunks per
    iteration); a loop whose first iteration the compiler peeled starts at 1. A step that
    cannot be read is 1, a start 0 (``lax.scan``'s). Else 1.

    Args:
      while_line: the ``while`` instruction's line.
      condition: the lines of its condition computation.
      body: the lines of its body computation (``()``: a step of 1).
      caller: the lines of the computation holding the loop (``()``: a start of 0).

    Returns:
      The trip count.
    """
    known = _KNOWN_TRIPS.search(while_line)
    if known:
        return int(known.group(1))
    bounds = [int(c.group(1)) for c in map(_CONSTANT.search, condition) if c]
    compare = [line for line in condition if " compare(" in line and "direction=LT" in line]
    if len(bounds) != 1 or not compare:
        return 1
    index = _counter_index(condition, compare[0])
    start = _counter_start(while_line, index, caller)
    return max(0, -(-(bounds[0] - start) // _counter_step(index, body)))


_INDEX = re.compile(r"\bindex=(\d+)")


def _counter_index(condition: Sequence[str], compare: str) -> int | None:
    """The tuple index of the loop counter that ``compare`` tests (a ``get-tuple-element`` of
    the condition's parameter); ``None`` where that is not the form."""
    first = re.findall(r"%[\w.\-]+", compare.split(" compare(", 1)[1])[:1]
    tested = _defs(condition).get(first[0]) if first else None
    if tested is None or tested["op"] != "get-tuple-element":
        return None
    index = _INDEX.search(tested.string)
    return None if index is None else int(index.group(1))


def _tuple_element(tuple_ins: re.Match | None, index: int | None,
                   defs: dict[str, re.Match]) -> re.Match | None:
    """The instruction defining element ``index`` of a ``tuple`` instruction, or ``None``."""
    if tuple_ins is None or tuple_ins["op"] != "tuple" or index is None:
        return None
    elements = re.findall(r"%[\w.\-]+", tuple_ins["args"])
    return defs.get(elements[index]) if index < len(elements) else None


def _defs(lines: Sequence[str]) -> dict[str, re.Match]:
    return {m["name"]: m for m in map(INSTRUCTION.match, lines) if m}


def _counter_step(index: int | None, body: Sequence[str]) -> int:
    """The step ``k`` of the loop counter at tuple ``index``, read from ``body``'s root tuple
    (``counter + k``, ``k`` a constant); 1 where that is not the form."""
    defs = _defs(body)
    root = next((m for line in body if line.lstrip().startswith("ROOT")
                 for m in [INSTRUCTION.match(line)] if m and m["op"] == "tuple"), None)
    new = _tuple_element(root, index, defs)
    if new is None or new["op"] != "add":
        return 1
    operands = [defs.get(o) for o in re.findall(r"%[\w.\-]+", new["args"])]
    same = [d for d in operands if d is not None and d["op"] == "get-tuple-element"
            and (i := _INDEX.search(d.string)) and int(i.group(1)) == index]
    steps = [int(c.group(1)) for d in operands if d is not None and d["op"] == "constant"
             for c in [_CONSTANT.search(d.string)] if c]
    return steps[0] if len(same) == 1 and len(steps) == 1 and steps[0] > 0 else 1


def _counter_start(while_line: str, index: int | None, caller: Sequence[str]) -> int:
    """The loop counter's initial value: element ``index`` of the loop's initial tuple in
    ``caller``, a constant or a copy of one; 0 where that is not the form."""
    loop = INSTRUCTION.match(while_line)
    if loop is None:
        return 0
    defs = _defs(caller)
    node = _tuple_element(defs.get(loop["args"].strip()), index, defs)
    while node is not None and node["op"] == "copy":
        node = defs.get(node["args"].strip())
    value = _CONSTANT.search(node.string) if node is not None and node["op"] == "constant" \
        else None
    return int(value.group(1)) if value else 0


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """The module's computations (in the module's order, a compiled module's schedule) and
    its entry.

    Args:
      hlo_text: the text of an HLO module.

    Returns:
      ``({computation name without '%': its instruction lines}, the entry's name)``; lines
      before the first computation (a fragment of one) under the name ``""``.
    """
    bodies: dict[str, list[str]] = {}
    entry, name = None, ""
    for line in hlo_text.splitlines():
        head = _HEAD.match(line)
        if head:
            name = head.group("name")
            bodies[name] = []
            entry = name if line.startswith("ENTRY") else entry
        else:
            bodies.setdefault(name, []).append(line)
    return bodies, entry


def executions(hlo_text: str) -> dict[str, int]:
    """How often each computation of an HLO module runs per call of its entry: a while loop's
    body its trip count (:func:`loop_trips`) times its caller's count, any other called
    computation as often as its callers.

    Args:
      hlo_text: the text of an HLO module.

    Returns:
      ``{computation name: executions}`` (the entry: 1; computations never called: absent).
    """
    bodies, entry = computations(hlo_text)
    counts: dict[str, int] = {}

    def visit(comp: str, n: int, depth: int = 0) -> None:
        counts[comp] = counts.get(comp, 0) + n
        if depth > 64:
            return
        for line in bodies.get(comp, ()):
            calls = {m.group("how"): [c.strip().lstrip("%") for c in m.group("names").split(",")]
                     for m in _CALLED.finditer(line)}
            trips = 1
            if "body" in calls:
                trips = loop_trips(line, bodies.get(calls.get("condition", [""])[0], ()),
                                   bodies.get(calls["body"][0], ()), bodies.get(comp, ()))
            for how, names in calls.items():
                for callee in names:
                    visit(callee, n * (trips if how == "body" else 1), depth + 1)

    if entry is not None:
        visit(entry, 1)
    return counts


def wire_bytes(fn_or_compiled, *args, **kwargs) -> WireReport:
    """Collectives and bytes per device of a compiled computation.

    Accepts a ``jax.jit``-wrapped function with example arguments (it is lowered and compiled,
    not run), a ``jax.stages.Compiled``, a ``jax.stages.Lowered``, or HLO text.

    Args:
      fn_or_compiled: a jitted function, a ``Compiled``, a ``Lowered`` or HLO text.
      *args: example positional arguments of a jitted function (shapes only matter).
      **kwargs: its example keyword arguments.

    Returns:
      The :class:`WireReport`.
    """
    import jax

    obj = fn_or_compiled
    if isinstance(obj, str):
        return parse_hlo(obj)
    if not isinstance(obj, jax.stages.Lowered | jax.stages.Compiled):
        obj = obj.lower(*args, **kwargs)
    if isinstance(obj, jax.stages.Lowered):
        obj = obj.compile()
    return parse_hlo(obj.as_text())
