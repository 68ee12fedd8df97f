"""The lift as one sparse matrix ``F_bev = W @ F_img``: ``bevcompile matrix`` -> ``matrix/``.

* :mod:`.build` — options, products, the ``matrix/`` group and ``run_matrix`` (states the conventions).
* :mod:`.entries` — frustum rays, grid-mode entries and the streamed two-pass Top-K build.
* :mod:`.layout` — ELL, row tiles, per-row int8.
* :mod:`.reference` — deliberately naive references (full build, BEVDet-style pooling, grid pooling).
* :mod:`.checks` — the ``inspect`` / ``verify`` / ``--strict`` plug-in of ``matrix/``.

May import: :mod:`bevcompile.grid` (the sampling grid, bilinear corners, memory guard of the
grid), :mod:`bevcompile.rig`, :mod:`bevcompile.store`, :mod:`bevcompile.errors`, :mod:`bevcompile.memory`.

``bevcompile.matrix.<name>`` also serves the names of the 0.2 module ``bevcompile.matrix`` (now :mod:`.build`).
"""

from .._legacy import package_getattr

__getattr__ = package_getattr(__name__, ("build",))
