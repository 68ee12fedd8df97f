"""The lift as one sparse matrix ``F_bev = W @ F_img``: ``bevcompile matrix`` -> ``matrix/``.

* :mod:`.build` — options, products, the ``matrix/`` group and ``run_matrix`` (states the conventions).
* :mod:`.topk` — the Top-K rule and the streamed, bounded two-pass selection a mode plugs into
  (``EntryStream``: blocks, pass-1 counting, pass-2 candidates; ``--jobs`` threads, folded in block order).
* :mod:`.entries` — frustum rays and the frustum mode as an ``EntryStream``; grid-mode entries.
* :mod:`.ray` — the ray mode (frustum points folded over depth with a prior) as an ``EntryStream``.
* :mod:`.prior` — the ray mode's depth prior: read, checked, normalised per pixel, recorded.
* :mod:`.scatter` — ``np.add.at``'s scatter-add without the GIL, for the streams' worker threads.
* :mod:`.lift32` / :mod:`.lift16` — upstream lifts in the model's own dtype (``--precision float32``:
  BEVDet's float32 lift; ``float16``: BEVDepth's ``get_geometry`` under float16 autocast, emulated).
* :mod:`.layout` — ELL, row tiles, per-row int8.
* :mod:`.reference` — deliberately naive references (full build, BEVDet-style pooling, grid pooling).
* :mod:`.checks` — the ``inspect`` / ``verify`` / ``--strict`` plug-in of ``matrix/``.

May import: :mod:`bevcompile.grid` (the sampling grid, bilinear corners, memory guard of the
grid), :mod:`bevcompile.rig`, :mod:`bevcompile.store`, :mod:`bevcompile.errors`, :mod:`bevcompile.memory`,
:mod:`bevcompile.parallel` (``--jobs``); scipy (:mod:`.scatter`).

``bevcompile.matrix.<name>`` also serves the names of the 0.2 module ``bevcompile.matrix`` (now :mod:`.build`).
"""

from .._legacy import package_getattr

__getattr__ = package_getattr(__name__, ("build",))
