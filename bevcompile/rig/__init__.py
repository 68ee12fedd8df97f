"""The calibrated rig: what is mounted where, and the geometry of each camera.

* :mod:`.config` — the rig config: frozen dataclasses built by ``parse_config`` (the ONLY module
  that reads YAML), field-path errors, ``config_sha256``.
* :mod:`.geometry` — lens models, projection and unprojection, camera poses (``ego_from_cam``,
  ``bev_from_cam`` in the BEV frame).
* :mod:`.presets` — model presets (``preset:``): the settings each model family fixes, with the
  repository, file and commit of every value.

May import: :mod:`bevcompile.errors` and :mod:`bevcompile.files` (the reader of user-named files, which every
package may import). Nothing else of bevcompile (every product imports this).
"""
