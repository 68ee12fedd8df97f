"""Choosing a graph form for a target: the profile's limits against what each form would build.

:func:`plan_for_target` tries the profile's forms in order (or the one ``--form`` names), builds
each candidate (cheap: numpy and ``onnx.helper``, no compiler), measures it
(:func:`bevcompile.deploy.graph.graph_cost`) and checks it against every limit of the profile
(:func:`limit_violations`); the first form with no violation wins. When none fits, ONE line says,
per form, which limit and by how much, and what to do: a
:class:`~bevcompile.errors.UsageError` (exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import UsageError
from .graph import GraphCost, Plan, build_graph, choose_window_patch, graph_cost, window_patch_ladder
from .lift import LiftMatrix
from .targets import TargetProfile

VALUE_BYTES = {"float32": 4, "float16": 2, "int8": 1, "int8-qdq": 1, "mixed": 2}


@dataclass
class Candidate:
    """One form tried for a target: its plan, the built model and its cost (None when the form was
    refused before building), and what it violates."""

    plan: Plan | None
    model: Any
    cost: GraphCost | None
    activations: list[str]
    violations: list[str]


def _fmt(n: float, unit: str = "count") -> str:
    if unit == "bytes":
        return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{int(n):,} B"
    return f"{int(n):,}" if float(n).is_integer() else f"{n:g}"


def limit_violations(profile: TargetProfile, model: Any, cost: GraphCost) -> list[str]:
    """Every limit of ``profile`` the graph breaks, one phrase each (empty: it fits)."""
    out = []
    p = profile

    def over(key: str, value: float, what: str) -> None:
        limit = p.limit(key)
        unit = p.limits[key].unit if key in p.limits else "count"
        if limit is not None and value > limit:
            out.append(f"{what} {_fmt(value, unit)} > {key} {_fmt(limit, unit)}")

    over("gather.max_indices", cost.max_gather_indices, "a Gather of")
    over("gather.max_axis", cost.max_gather_axis, "a Gather data axis of")
    over("nodes.max", cost.nodes, "nodes")
    over("weights.max_bytes", cost.constant_bytes, "constants")
    per_run = p.limit("gather.compiled_bytes_per_run")
    ratio = p.limit("compiled.max_ratio")
    if per_run is not None and ratio is not None and cost.index_runs:
        compiled = cost.index_runs * per_run + cost.constant_bytes
        if compiled > ratio * max(cost.constant_bytes, 1):
            out.append(
                f"{cost.index_runs:,} Gather index runs compile to about {_fmt(compiled, 'bytes')} ({compiled / max(cost.constant_bytes, 1):.0f}x "
                f"the constants) > compiled.max_ratio {ratio:g}"
            )
    transpose = p.int_limit("transpose.max_product")
    if transpose is not None:  # the shapes graph_cost inferred: no second shape inference
        over_limit = next(((a, b) for a, b in cost.transposes_3d if a * b > transpose), None)
        if over_limit is not None:
            out.append(f"a Transpose of {over_limit[0]:,} x {over_limit[1]:,} > transpose.max_product {transpose:,}")
    rank = p.int_limit("rank.max")
    if rank is not None:
        io = list(model.graph.input) + list(model.graph.output)
        worst = max(len(vi.type.tensor_type.shape.dim) for vi in io)
        if worst > rank:
            out.append(f"an input/output of rank {worst} > rank.max {rank}")
    return out


def _window_patches(profile: TargetProfile, lift: LiftMatrix, plan: Plan) -> tuple[list[tuple[int, int]], list[str]]:
    """The patch sizes whose block bytes and node estimate fit, largest first (the caller builds them
    in turn: the graph's other constants may still tip one over); or ``([], reasons)``."""
    if lift.frustum:
        return [], ["its blocks must be constants, but a frustum lift multiplies each entry by the depth input"]
    budget = profile.int_limit("weights.max_bytes")
    nodes = profile.int_limit("nodes.max")
    value_bytes = VALUE_BYTES[plan.weights]
    by_output = lift.by_output()
    first, tried = choose_window_patch(by_output, budget, nodes, value_bytes)
    if first is None:
        within_nodes = [s for s in tried if nodes is None or s.nodes() <= nodes]
        if within_nodes:
            best = min(within_nodes, key=lambda s: s.block_values)
            return [], [
                f"its blocks need {_fmt(best.block_values * value_bytes, 'bytes')} at {best.patch[0]}x{best.patch[1]} patches "
                f"> weights.max_bytes {_fmt(budget or 0, 'bytes')} (smaller patches: more than nodes.max {nodes or 0:,} nodes)"
            ]
        fewest = min(tried, key=lambda s: s.nodes())
        return [], [f"even {fewest.patch[0]}x{fewest.patch[1]} patches need {fewest.nodes():,} nodes > nodes.max {nodes or 0:,}"]
    later = [p for p in window_patch_ladder(lift.out_shape) if p[0] * p[1] < first.patch[0] * first.patch[1]]
    return [first.patch, *later][:4], []


def plan_for_target(
    profile: TargetProfile,
    lift: LiftMatrix,
    *,
    channels: int,
    batch: int,
    opset: int,
    weights: str,
    qdq_activations: bool = False,
    form: str | None = None,
    layout: str | None = None,
    tile_rows: int | None = None,
    product: str = "",
    guard: bool = False,
) -> tuple[Candidate, list[tuple[str, list[str]]]]:
    """The first form of ``profile`` (or ``form``) whose graph fits every limit: ``(candidate, refused)``
    with ``refused`` the forms tried before it and why. Raises :class:`UsageError` (one line) when no
    form fits."""
    int8 = weights in ("int8", "int8-qdq")
    forms = [form] if form else [f for f in (profile.int8_forms if int8 else profile.forms) if f != "torch"]
    if not form and weights == "mixed" and "gather" in forms:  # two row groups: the gather form
        forms = ["gather"]
    if not form and product == "tiles" and "tiles" in forms:  # the tiles product in its own form where the target has it
        forms.remove("tiles")
        forms.insert(0, "tiles")
    if not forms:
        raise UsageError(f"--target {profile.name} exports the torch modules' graphs (--exporter legacy or dynamo), not a planned form")
    max_batch = profile.int_limit("batch.max")
    if max_batch is not None and batch > max_batch:
        raise UsageError(f"--target {profile.name}: --batch {batch} > batch.max {max_batch} ({profile.limits['batch.max'].source}); export --batch 1")
    notes = []
    multiple = profile.int_limit("channels.multiple")
    if multiple and channels % multiple:
        notes.append(f"{profile.name} computes channels in blocks of {multiple}: C = {channels} fills {channels % multiple} of the last block's {multiple} lanes")
    base = Plan(
        form=forms[0], layout=layout or profile.layout, input_rank=profile.input_rank, batch=batch, channels=channels, opset=opset,
        weights=weights, qdq_activations=qdq_activations, per_axis=profile.int8_per_axis,
        max_indices=profile.int_limit("gather.max_indices"), max_axis=profile.int_limit("gather.max_axis"),
        tile_rows=tile_rows, guard=guard, notes=tuple(notes),
    )
    refused: list[tuple[str, list[str]]] = []
    for name in forms:
        plans = [replace(base, form=name)]
        if name == "windows":
            patches, reasons = _window_patches(profile, lift, base)
            if not patches:
                refused.append((name, reasons))
                continue
            plans = [replace(base, form=name, patch=patch) for patch in patches]
        violations: list[str] = []
        for plan in plans:  # windows: the largest patch whose whole graph fits, then smaller ones
            model, acts = build_graph(lift, plan)
            cost = graph_cost(model)
            violations = limit_violations(profile, model, cost)
            if not violations:
                return Candidate(plan, model, cost, acts, []), refused
        refused.append((name, violations))
    raise UsageError(refusal_message(profile, lift, product, refused))


def refusal_message(profile: TargetProfile, lift: LiftMatrix, product: str, refused: list[tuple[str, list[str]]]) -> str:
    """One line: the product, each form and the (first two) limits it breaks, what to do."""
    what = "; ".join(f"{form}: {', '.join(reasons[:2])}" for form, reasons in refused)
    if lift.frustum:
        advice = "build the matrix with --mode ray (the depth prior folded into constant weights), a bev.region, or fewer rows"
    else:
        advice = "restrict the BEV grid with a bev.region (and --rows compact), use fewer rows or a smaller feature map"
    return (
        f"--target {profile.name} cannot take --product {product or lift.kind} of this store ({lift.mode} mode, {lift.nnz:,} entries, "
        f"{lift.n_rows:,} rows): {what}. To fit: {advice}"
    )


__all__ = ["VALUE_BYTES", "Candidate", "limit_violations", "plan_for_target", "refusal_message"]
