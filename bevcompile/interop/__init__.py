"""Arrays for the deployment paths people already run: ``bevcompile export-interop`` -> ``interop/``.

* :mod:`.bevpoolv2` — BEVDet's five BEVPoolv2 arrays (``voxel_pooling_prepare_v2``), for a fixed batch.
* :mod:`.fastbev` — the Fast-BEV look-up table (``backproject_inplace``), with its overlap policies.
* :mod:`.petr` — PETR's 3D position coordinates and mask (``position_embeding``), a constant of the rig.
* :mod:`.export` — the ``interop/`` group, ``.npy`` files and ``run_export_interop``.
* :mod:`.checks` — the ``inspect`` / ``verify`` / ``--strict`` plug-in of ``interop/``.

May import: :mod:`bevcompile.grid`, :mod:`bevcompile.matrix` (frustum rays), :mod:`bevcompile.rig`,
:mod:`bevcompile.store`, :mod:`bevcompile.errors`, :mod:`bevcompile.parallel` (``--jobs``),
:mod:`bevcompile.memory`, :mod:`bevcompile.conventions` (the region sentence recorded in ``interop/``).

``bevcompile.interop.<name>`` also serves the names of the 0.2 module ``bevcompile.interop``.
"""

from .._legacy import package_getattr

__getattr__ = package_getattr(__name__, ("bevpoolv2", "fastbev", "export"))
