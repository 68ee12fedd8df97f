"""The NPU toolchains, each in its own virtual environment, driven through files.

* ``rknn_worker.py``, ``openvino_worker.py``, ``litert_worker.py`` — standalone scripts run by the
  toolchain's OWN Python (``.venv-npu/<toolchain>/bin/python``, made by ``make npu-envs`` from
  ``toolchains/<toolchain>.txt``): they import numpy and the toolchain, never bevcompile; they read a
  JSON spec (the ONNX file, the inputs ``.npz``, the calibration set) and write a JSON result plus
  the output ``.npy``.
* :mod:`.harness` — the project side: exports a product for a target (:func:`bevcompile.deploy.
  onnx_export.export_onnx`), runs the worker, compares its output with the numpy reference and
  counts every limit / CPU-fallback line of the build as a failure.

May import (harness only): :mod:`bevcompile.deploy`, :mod:`bevcompile.store`, :mod:`bevcompile.errors`.
"""
