"""The zarr v3 store: writing it atomically, reading it for models, checking it.

* :mod:`.zarr_io` — the ONLY module that touches zarr or the store's files (atomic writes, the reader).
* :mod:`.root` — the root attributes every store carries (format, version, config, conventions).
* :mod:`.loader` — ``bevcompile.load``: a typed, read-only, hash-verified view for model code.
* :mod:`.plugins` — the plug-in contract between product groups and inspect / verify / --strict.
* :mod:`.inspection` — the ``inspect`` runner (damage-robust; calls the product plug-ins by name).
* :mod:`.verify` — the ``verify`` runner and its seeded inputs.

May import: :mod:`bevcompile.rig`, :mod:`bevcompile.errors`, :mod:`bevcompile.conventions`; products
only by plug-in name (``GROUP_PLUGINS``), and :mod:`bevcompile.grid.ipm` for the contract's cached
sampling grid. Products import this package, never the reverse.

``bevcompile.store.<name>`` also serves the names of the 0.2 module ``bevcompile.store`` (now :mod:`.zarr_io`).
"""

from .._legacy import package_getattr

__getattr__ = package_getattr(__name__, ("zarr_io",))
