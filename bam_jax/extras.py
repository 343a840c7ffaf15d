"""The extras of the bam-jax distribution that the commands need, and the check a command
runs before importing them: a missing extra ends it with one line that names the install.

Only the standard library is imported here, so the check works on a bare `pip install bam-jax`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

# Extra -> {distribution: the module it installs}, as declared in pyproject.toml.
EXTRA_REQUIREMENTS: dict[str, dict[str, str]] = {
    "train": {
        "optax": "optax",
        "orbax-checkpoint": "orbax.checkpoint",
        "grain": "grain",
        "ml-collections": "ml_collections",
        "absl-py": "absl",
        "etils": "etils",
        "tensorboardX": "tensorboardX",
        "tqdm": "tqdm",
        "sentencepiece": "sentencepiece",
        "mistral-common": "mistral_common",
    },
    "eval": {
        "orbax-checkpoint": "orbax.checkpoint",
        "etils": "etils",
        "tqdm": "tqdm",
        "matplotlib": "matplotlib",
        "sentencepiece": "sentencepiece",
        "mistral-common": "mistral_common",
    },
}
EXTRA_DESCRIPTIONS = {"train": "training", "eval": "evaluation"}


def is_importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package of a dotted name is missing
        return False


def missing_requirements(extras: Sequence[str]) -> list[str]:
    """The distributions of the given extras whose modules cannot be imported."""
    requirements = {
        distribution: module
        for extra in extras
        for distribution, module in EXTRA_REQUIREMENTS[extra].items()
    }
    return [dist for dist, module in requirements.items() if not is_importable(module)]


def require_extras(command: str, extras: Sequence[str]) -> None:
    """Exit with one line naming the install when a module of the extras is missing."""
    missing = missing_requirements(extras)
    if missing:
        described = " and ".join(EXTRA_DESCRIPTIONS[extra] for extra in extras)
        plural = "s" if len(extras) > 1 else ""
        sys.exit(
            f"{command} needs the {described} extra{plural}: "
            f"pip install 'bam-jax[{','.join(extras)}]' (missing: {', '.join(missing)})"
        )
