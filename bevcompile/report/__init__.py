"""Reports over stores for people: how a recalibration moves the tables, and what the cameras cover.

* :mod:`.diff` — ``bevcompile diff``: config and pose changes, coverage, sampling shift, output change.
* :mod:`.render` — ``bevcompile render``: the coverage PNG (matplotlib, extra ``[plot]``).

May import: :mod:`bevcompile.store` (reading), :mod:`bevcompile.grid`, :mod:`bevcompile.rig`, :mod:`bevcompile.errors`.
"""
