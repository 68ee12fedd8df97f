"""Running a store in a model: PyTorch modules and static ONNX graphs (extras ``[torch]``, ``[onnx]``).

* :mod:`.torch` — ``GridGather`` and ``MatrixLift`` (public name :mod:`bevcompile.torch`).
* :mod:`.onnx_export` — ``bevcompile export-onnx``: export, onnxruntime check, metadata.
* :mod:`.onnx_graph` — the graph scan: forbidden ops, static shapes, node counts.
* :mod:`.targets` — the NPU target profiles (``bevcompile/data/targets/*.toml``, ``bevcompile targets``).
* :mod:`.lift` — every product as one sparse :class:`~.lift.LiftMatrix` (numpy only).
* :mod:`.graph` — the graph builder: the forms (gather, tiles, windows) written op by op, their cost.
* :mod:`.plan` — a target's form chosen against its limits (one-line refusals).
* :mod:`.direct` — ``export-onnx --target``: the builder's graphs, checked like the torch path's.
* :mod:`.toolchains` — the RKNN / OpenVINO / LiteRT workers (their own venvs) and the harness.

May import: :mod:`bevcompile.store` (the loader), :mod:`bevcompile.grid` and :mod:`bevcompile.matrix`
(table layouts), :mod:`bevcompile.errors`. torch / onnx only inside this package.
"""
