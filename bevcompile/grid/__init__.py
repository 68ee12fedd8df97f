"""IPM sampling grids and everything made from them: ``bevcompile grid`` -> ``grid/``, ``gather/``, ``delta/``.

* :mod:`.ipm` — the float64 sampling grid of every BEV cell in every camera (the reference).
* :mod:`.gather` — static Gather indices + bilinear weights (``gather/``).
* :mod:`.formats` — fixed-point coordinate formats (``norm_int16``, ``uq12``, ``opencv``, ...).
* :mod:`.delta` — the block-wise delta-LUT (``delta/``).
* :mod:`.reference` — an independent numpy ``grid_sample`` (PyTorch's formula, no torch).
* :mod:`.build` — the groups and the command behind ``bevcompile grid`` (``run_grid``).
* :mod:`.checks` — the ``inspect`` / ``verify`` / ``--strict`` plug-ins of these groups.

May import: :mod:`bevcompile.rig`, :mod:`bevcompile.store` (the writer; the plug-in contract),
:mod:`bevcompile.errors`, :mod:`bevcompile.conventions`, :mod:`bevcompile.memory`.

``bevcompile.grid.<name>`` also serves the names of the 0.2 module ``bevcompile.grid`` (now :mod:`.ipm`).
"""

from .._legacy import package_getattr

__getattr__ = package_getattr(__name__, ("ipm",))
