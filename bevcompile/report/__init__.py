"""Reports over stores for people: how a recalibration moves the tables, and what the cameras cover.

* :mod:`.diff` — ``bevcompile diff``: config and pose changes, coverage, sampling shift, output change.
* :mod:`.render` — ``bevcompile render``: the coverage PNG and the precision PNG (matplotlib, extra ``[plot]``).
* :mod:`.precision` — ``bevcompile verify --map``: per BEV cell, the error of every deployed form
  (a registry of forms) against its float64 reference, per distance band and camera.

May import: :mod:`bevcompile.store` (reading), :mod:`bevcompile.grid`, :mod:`bevcompile.matrix` (the
deployed forms' decoding and references, for the precision map), :mod:`bevcompile.rig`, :mod:`bevcompile.errors`.
"""
