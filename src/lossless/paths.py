"""Where the project's shipped data lives (prompt suite, training prompts, heads)."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[1]
SUITES_DIR = REPO_ROOT / "suites"
DATA_DIR = REPO_ROOT / "data"
HEADS_DIR = REPO_ROOT / "heads"
DEFAULT_SUITE = SUITES_DIR / "default.jsonl"
TRAIN_PROMPTS = DATA_DIR / "train_prompts.jsonl"
HELDOUT_PROMPTS = DATA_DIR / "heldout_prompts.jsonl"
