"""PyTorch modules that run a store's tables: the public name of :mod:`bevcompile.deploy.torch`.

``from bevcompile.torch import GridGather, MatrixLift`` (extra ``[torch]``); see that module.
"""

from __future__ import annotations

from .deploy.torch import *  # noqa: F403
from .deploy.torch import __all__ as __all__
