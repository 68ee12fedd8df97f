__version__ = "0.3.0"

TORCH_REQUIREMENT = "torch>=2.13,<3"
"""The ``[torch]`` extra's requirement, as pyproject.toml declares it (tests/test_packaging.py
checks that the two agree): what the messages of a missing PyTorch ask for."""
