"""Options shared by several commands, defined once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..choices import canonical_choice as canonical_choice  # re-exported: the commands import it from here

ConfigArg = Annotated[
    Path | None,
    typer.Argument(
        help="Rig config YAML. Default: the bundled nuScenes rig (real calibration, BEVDet-R50 settings).",
        show_default=False,
        metavar="CONFIG",
    ),
]
OutOption = Annotated[
    Path, typer.Option("--out", "-o", help="Output folder; the store is <out>/<name>.zarr.")
]
ForceOption = Annotated[
    bool, typer.Option("--force", help="Replace a store that was built from a different config.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (for scripts).")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary table.")]
FeatureSeedOption = Annotated[int, typer.Option("--seed", help="Seed (>= 0) of the random features (verify and diff draw the same ones).")]
FeatureChannelsOption = Annotated[int, typer.Option("--channels", help="Feature channels C of the random features, 1 to 512.")]
JobsOption = Annotated[
    int | None,
    typer.Option(
        "--jobs",
        "-j",
        help="Threads of the build (default: the cores this process may use); the output is the same bytes for every value.",
        show_default=False,
    ),
]
DEFAULT_OUT = Path("artifacts")


