"""``inspect`` / ``verify`` / ``inspect --strict`` plug-ins of the grid products (one module per group part).

* :mod:`.base` — ``grid/``'s four base arrays (coords, valid, norm, norm_int16).
* :mod:`.formats` — ``grid/``'s fixed-point format arrays.
* :mod:`.gather` — ``gather/``.
* :mod:`.delta` — ``delta/``.

Each implements the contract of :mod:`bevcompile.store.plugins` (pure functions, no zarr, no printing).
May import: :mod:`bevcompile.grid`, :mod:`bevcompile.rig`, :mod:`bevcompile.store.plugins`.
"""

from ..._legacy import package_getattr

__getattr__ = package_getattr(__name__, ("formats", "gather", "delta", "_common"))
