"""What several test files share: case definitions, plain references, runs and fixtures'
helpers. Test files import from here, never from each other."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
