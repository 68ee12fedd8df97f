"""Calibration importers: a rig config from what calibration tools and datasets write.

* :mod:`.kalibr` — Kalibr's multi-camera calibration (``camchain.yaml``: ``cam0`` .. ``camN``).
* :mod:`.nuscenes` — the nuScenes devkit's JSON tables (``scene``, ``sample``, ``sample_data``,
  ``calibrated_sensor``, ``sensor``, ``log``): the cameras and LIDAR_TOP of one scene.
* :mod:`.opencv` — one camera from an OpenCV ``FileStorage`` YAML file, merged into a rig.
* :mod:`._common` — the model-settings template, rigid transforms, the output rig data.

Each importer is a pure function from the parsed file (plain data) to rig config data (what
:func:`bevcompile.rig.config.parse_config` validates), plus a thin ``import_*`` reading the
file; numbers are copied exactly (poses that must be composed are computed in float64 and
written as ``sensor2ego``). Bad input is a :class:`~bevcompile.errors.ConfigError` naming the
file and the field path in the SOURCE format (``camchain.yaml: cam1.distortion_model: ...``).
``bevcompile import kalibr|nuscenes|opencv`` and the fleet manifest's ``import:`` sources use them.

May import: :mod:`bevcompile.rig.config` (the YAML reader and parsing helpers), :mod:`bevcompile.errors`.
"""
