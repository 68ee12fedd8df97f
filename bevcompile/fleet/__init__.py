"""Fleet compilation: one command compiles the stores of thousands of per-vehicle calibrations.

* :mod:`.manifest` — the fleet manifest (YAML): the products and their options, the model
  template, the vehicles and their calibration sources; field-path errors before any work.
* :mod:`.products` — the products of a vehicle (``grid``, ``matrix``, ``export-interop``): the
  options of the single commands, built with the same library functions (``run_grid``,
  ``run_matrix``, ``run_export_interop``), so a fleet store is byte-identical to theirs.
* :mod:`.resolve` — a vehicle's resolved rig config from its sources (rig file, cameras with the
  template, importers, overlay), errors named in the file the problem is in.
* :mod:`.task` — one vehicle, in one worker process: resolve, resume check, build in a staging
  folder, inspect, put in place atomically, figures, calibration shift against the reference.
* :mod:`.engine` — the Dask engine (extra ``[fleet]``): an embedded ``LocalCluster`` or an existing
  cluster (``--scheduler``), its checks (same bevcompile version, shared output folder),
  progress, cancellation.
* :mod:`.index` — ``<out>/fleet.json`` and ``fleet.csv`` (rewritten atomically), flags, the report.

May import: :mod:`bevcompile.grid`, :mod:`bevcompile.matrix`, :mod:`bevcompile.interop`,
:mod:`bevcompile.report` (the ``diff`` machinery), :mod:`bevcompile.rig` (configs and importers),
:mod:`bevcompile.store`, :mod:`bevcompile.errors`, :mod:`bevcompile.choices`. ``dask`` only in
:mod:`.engine` (and the worker-side helpers of :mod:`.task`).
"""
