"""NPU target profiles: what a deployment target's compiler accepts, as data with a source.

A profile is a TOML file (``bevcompile/data/targets/<name>.toml``, or any file given as
``--target path/to/profile.toml``) parsed by :func:`parse_profile` into a frozen
:class:`TargetProfile`. Nothing in the graph builder branches on a target's NAME: it reads the
profile's limits (``gather.max_indices``, ``weights.max_bytes`` ...), its preferred graph forms,
layout, input rank and int8 route, so adding a target is adding a file.

Every limit, rewrite and runtime setting carries its ``source``: the toolchain documentation it
comes from, or the build that measured it (``measured: ...``, reproducible with
``benchmarks/npu_check.py``). ``bevcompile targets`` lists the profiles and ``bevcompile targets
NAME`` prints every entry with its source.

Convention (the keys the graph builder reads; a profile may hold more, they are shown, not used):

=============================  =======  ====================================================
limit                          unit     meaning
=============================  =======  ====================================================
``gather.max_indices``         count    longest index list of one Gather
``gather.max_axis``            count    longest data axis a Gather reads
``gather.compiled_bytes_per_run`` bytes compiled size of one run of consecutive Gather indices
``transpose.max_product``      count    largest Transpose the NPU runs (the product of its two
                                        innermost moved axes); larger ones fall back to the CPU
``rank.max``                   count    highest tensor rank of an input or output
``batch.max``                  count    largest static batch N
``weights.max_bytes``          bytes    budget of constant bytes of one lift graph
``compiled.max_ratio``         ratio    budget of the compiled size over the graph's constant bytes
``channels.multiple``          count    channel block the NPU computes in (C is padded to it)
``nodes.max``                  count    node budget of one graph (the compiler's passes are
                                        superlinear in the node count)
=============================  =======  ====================================================
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UsageError, _WhereError

FORMS = ("gather", "windows", "tiles", "torch")
"""Graph forms the builder emits (:mod:`bevcompile.deploy.graph`): ``gather`` (one weighted Gather
of whole feature vectors per ELL entry, reduced over K), ``windows`` (Slice of a contiguous feature
window per camera and BEV patch + MatMul with the dense block: no Gather), ``tiles`` (Gather of a row
tile's columns + MatMul), ``torch`` (today's graphs: the torch modules traced by torch.onnx.export)."""
LAYOUTS = ("channel-last", "channel-first")
"""Where the channel axis sits while the lift gathers: ``channel-last`` gathers whole ``C``-vectors
(``(P, C)`` rows; one Transpose at each end), ``channel-first`` gathers along the pixel axis of
``(1, C, 1, P)`` (no Transpose; the layout of NPUs with a channel-blocked native format)."""
DTYPES = ("float32", "float16", "int8")
INT8_ROUTES = ("qdq", "toolchain-calibration", "none")
"""How a target gets int8: ``qdq`` — the graph carries QuantizeLinear/DequantizeLinear with the
scales bevcompile calibrated; ``toolchain-calibration`` — the float graph plus a calibration set
(``<out>.calib/``) that the toolchain's own quantiser reads; ``none`` — no int8 route."""
TOOLCHAINS = ("none", "onnxruntime", "rknn", "openvino", "litert")
PROFILE_MAX_BYTES = 1 << 20
"""A profile file larger than this is refused before it is read."""
LIMIT_KEYS = {
    "gather.max_indices": "count",
    "gather.max_axis": "count",
    "gather.compiled_bytes_per_run": "bytes",
    "transpose.max_product": "count",
    "rank.max": "count",
    "batch.max": "count",
    "weights.max_bytes": "bytes",
    "compiled.max_ratio": "ratio",
    "channels.multiple": "count",
    "nodes.max": "count",
}


class TargetError(_WhereError, ValueError):
    """A target profile file that cannot be read: ``<file>: <field path>: <what is wrong>``."""


@dataclass(frozen=True)
class Limit:
    """One limit of a target. ``value`` in ``unit`` (see the module table); ``source`` says where
    it comes from (a document, or ``measured: <the build>``)."""

    key: str
    value: float
    unit: str
    source: str

    def to_json(self) -> dict[str, Any]:
        value: float | int = int(self.value) if float(self.value).is_integer() else self.value
        return {"key": self.key, "value": value, "unit": self.unit, "source": self.source}


@dataclass(frozen=True)
class Note:
    """A converter rewrite (``what`` the toolchain turns a pattern into) or a runtime setting a user
    must make, with its source."""

    pattern: str
    what: str
    source: str

    def to_json(self) -> dict[str, str]:
        return {"pattern": self.pattern, "what": self.what, "source": self.source}


@dataclass(frozen=True)
class TargetProfile:
    """One deployment target (see the module docstring).

    Convention: ``forms`` the graph forms in order of preference (the builder takes the first that
    fits the limits); ``layout`` of the ``gather`` form; ``input_rank`` 4 (features
    ``(N * n_cam, C, H_f, W_f)``, the backbone's own output, and ``(N, C, ny, nx)`` out) or 5
    (``(N, n_cam, C, H_f, W_f)``); ``compute`` the dtypes the device computes in (``float32`` means
    the graph runs as written); ``int8`` the route of :data:`INT8_ROUTES`.
    """

    name: str
    description: str
    toolchain: str
    platform: str
    compute: tuple[str, ...]
    forms: tuple[str, ...]
    layout: str
    input_rank: int
    int8: str
    int8_source: str
    int8_per_axis: bool
    int8_forms: tuple[str, ...]
    limits: dict[str, Limit]
    rewrites: tuple[Note, ...]
    runtime: tuple[Note, ...]
    path: str

    def limit(self, key: str, default: float | None = None) -> float | None:
        """The value of limit ``key`` (None or ``default`` when the target has none)."""
        entry = self.limits.get(key)
        return entry.value if entry is not None else default

    def int_limit(self, key: str) -> int | None:
        value = self.limit(key)
        return None if value is None else int(value)

    @property
    def computes_float(self) -> bool:
        return "float32" in self.compute or "float16" in self.compute

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "toolchain": self.toolchain,
            "platform": self.platform,
            "compute": list(self.compute),
            "forms": list(self.forms),
            "layout": self.layout,
            "input_rank": self.input_rank,
            "int8": {"route": self.int8, "per_axis": self.int8_per_axis, "forms": list(self.int8_forms), "source": self.int8_source},
            "limits": [limit.to_json() for limit in self.limits.values()],
            "rewrites": [note.to_json() for note in self.rewrites],
            "runtime": [note.to_json() for note in self.runtime],
        }


# --------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, path: str) -> Any:
    if key not in data:
        raise TargetError(where, f"{path}{key}", "missing")
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TargetError(where, f"{path}{key}", f"must be a {names}, got {type(value).__name__}")
    return value


def _choice(data: dict[str, Any], key: str, allowed: tuple[str, ...], where: str) -> str:
    value = _field(data, key, str, where, "")
    if value not in allowed:
        raise TargetError(where, key, f"must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _notes(data: dict[str, Any], key: str, where: str) -> tuple[Note, ...]:
    entries = data.get(key, [])
    if not isinstance(entries, list):
        raise TargetError(where, key, "must be a list of tables ([[" + key + "]])")
    notes = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise TargetError(where, f"{key}[{i}]", "must be a table with pattern, what and source")
        notes.append(Note(*(str(_field(entry, k, str, where, f"{key}[{i}].")) for k in ("pattern", "what", "source"))))
    return tuple(notes)


def _forms(value: Any, where: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise TargetError(where, key, "must name at least one graph form")
    for i, form in enumerate(value):
        if form not in FORMS:
            raise TargetError(where, f"{key}[{i}]", f"must be one of {', '.join(FORMS)}, got {form!r}")
    return tuple(value)


def parse_profile(data: dict[str, Any], where: str) -> TargetProfile:
    """A :class:`TargetProfile` from a parsed TOML table; :class:`TargetError` naming the field."""
    name = _field(data, "name", str, where, "")
    compute = tuple(_field(data, "compute", list, where, ""))
    for i, dtype in enumerate(compute):
        if dtype not in DTYPES:
            raise TargetError(where, f"compute[{i}]", f"must be one of {', '.join(DTYPES)}, got {dtype!r}")
    forms = _forms(_field(data, "forms", list, where, ""), where, "forms")
    input_rank = _field(data, "input_rank", int, where, "")
    if input_rank not in (4, 5):
        raise TargetError(where, "input_rank", f"must be 4 or 5, got {input_rank}")
    int8 = _field(data, "int8", dict, where, "")
    route = _choice(int8, "route", INT8_ROUTES, where)
    limits: dict[str, Limit] = {}
    raw_limits = data.get("limits", {})
    if not isinstance(raw_limits, dict):
        raise TargetError(where, "limits", "must be a table of limits")
    for key, entry in raw_limits.items():
        if key not in LIMIT_KEYS:
            raise TargetError(where, f"limits.{key}", f"unknown limit (known: {', '.join(LIMIT_KEYS)})")
        if not isinstance(entry, dict):
            raise TargetError(where, f"limits.{key}", "must be a table with value and source")
        value = _field(entry, "value", (int, float), where, f"limits.{key}.")
        if not value > 0:
            raise TargetError(where, f"limits.{key}.value", f"must be > 0, got {value}")
        limits[key] = Limit(key, float(value), LIMIT_KEYS[key], str(_field(entry, "source", str, where, f"limits.{key}.")))
    return TargetProfile(
        name=str(name),
        description=str(_field(data, "description", str, where, "")),
        toolchain=_choice(data, "toolchain", TOOLCHAINS, where),
        platform=str(data.get("platform", "")),
        compute=compute,
        forms=forms,
        layout=_choice(data, "layout", LAYOUTS, where),
        input_rank=int(input_rank),
        int8=route,
        int8_source=str(_field(int8, "source", str, where, "int8.")),
        int8_per_axis=bool(_field(int8, "per_axis", bool, where, "int8.")) if "per_axis" in int8 else True,
        int8_forms=_forms(int8["forms"], where, "int8.forms") if "forms" in int8 else forms,
        limits=limits,
        rewrites=_notes(data, "rewrites", where),
        runtime=_notes(data, "runtime", where),
        path=where,
    )


def _profile_dir() -> Any:
    return resources.files("bevcompile").joinpath("data", "targets")


def profile_names() -> list[str]:
    """The bundled profiles' names, sorted."""
    return sorted(entry.name.removesuffix(".toml") for entry in _profile_dir().iterdir() if entry.name.endswith(".toml"))


def is_profile_file(name_or_path: str) -> bool:
    """``--target`` names a profile file (``*.toml`` or a path), not a bundled profile."""
    return name_or_path.endswith(".toml") or "/" in name_or_path


def canonical_target(name_or_path: str) -> str:
    """``--target`` as given: a bundled name in lower case (``RK3588`` -> ``rk3588``), a file path as is."""
    return name_or_path if is_profile_file(name_or_path) else name_or_path.lower()


def load_profile(name_or_path: str) -> TargetProfile:
    """A bundled profile by name (``rk3588``) or a profile file (``path/to/x.toml``).

    :class:`UsageError` for an unknown name, :class:`TargetError` for a file that cannot be parsed.
    """
    if is_profile_file(name_or_path):
        path = Path(name_or_path)
        if not path.exists():
            raise UsageError(f"--target {name_or_path}: no such profile file (a bundled name is one of {', '.join(profile_names())})")
        where = str(path)
        from ..files import FileRefused, read_regular

        try:
            raw = read_regular(path, PROFILE_MAX_BYTES, "a target profile .toml")
        except FileRefused as exc:
            raise TargetError(where, "", exc.reason) from None
    else:
        entry = _profile_dir().joinpath(f"{name_or_path}.toml")
        if not entry.is_file():
            raise UsageError(f"--target must be one of {', '.join(profile_names())} or a profile .toml file, got {name_or_path!r}")
        where = f"bevcompile/data/targets/{name_or_path}.toml"
        raw = entry.read_bytes()
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TargetError(where, "", f"not a TOML file ({exc})") from None
    return parse_profile(data, where)


def load_profiles() -> list[TargetProfile]:
    """Every bundled profile, by name."""
    return [load_profile(name) for name in profile_names()]


__all__ = [
    "DTYPES",
    "FORMS",
    "INT8_ROUTES",
    "LAYOUTS",
    "LIMIT_KEYS",
    "Limit",
    "Note",
    "TargetError",
    "TargetProfile",
    "canonical_target",
    "is_profile_file",
    "load_profile",
    "load_profiles",
    "parse_profile",
    "profile_names",
]
