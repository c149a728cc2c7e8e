"""Where the project's shipped data lives: the prompt suite, training and held-out prompts, heads.

In a source checkout (an editable install) they are the checkout's `suites/`, `data/` and `heads/`; a
wheel carries copies of the same files under `lossless/_shipped/` (see pyproject.toml), so an install
finds them without the checkout. This module knows locations only, not file formats.
"""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
_SHIPPED = PACKAGE_DIR / "_shipped"  # present in a wheel install only
REPO_ROOT = PACKAGE_DIR.parents[1]  # the source checkout (meaningful in an editable install only)
ROOT = _SHIPPED if _SHIPPED.is_dir() else REPO_ROOT
SUITES_DIR = ROOT / "suites"
DATA_DIR = ROOT / "data"
HEADS_DIR = ROOT / "heads"
DEFAULT_SUITE = SUITES_DIR / "default.jsonl"
TRAIN_PROMPTS = DATA_DIR / "train_prompts.jsonl"
HELDOUT_PROMPTS = DATA_DIR / "heldout_prompts.jsonl"


def require(path: Path, what: str) -> Path:
    """`path` if it exists; else a LosslessError saying the install lacks `what` (never a silent skip)."""
    if not path.exists():
        from .errors import LosslessError

        raise LosslessError(f"{what} ({path}) is missing from this install: reinstall lossless, or pass the file")
    return path
