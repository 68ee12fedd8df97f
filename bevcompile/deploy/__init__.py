"""Running a store in a model: PyTorch modules and static ONNX graphs (extras ``[torch]``, ``[onnx]``).

* :mod:`.torch` — ``GridGather`` and ``MatrixLift`` (public name :mod:`bevcompile.torch`).
* :mod:`.onnx_export` — ``bevcompile export-onnx``: export, onnxruntime check, metadata.
* :mod:`.onnx_graph` — the graph scan: forbidden ops, static shapes, node counts.

May import: :mod:`bevcompile.store` (the loader), :mod:`bevcompile.grid` and :mod:`bevcompile.matrix`
(table layouts), :mod:`bevcompile.errors`. torch / onnx only inside this package.
"""
