"""Where the project's files are, for tests wherever they sit in tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project's root
TESTS = ROOT / "tests"
JOBS = TESTS / "jobs"  # training scripts that know nothing of rankwatch
DATA = TESTS / "data"  # recorded traces and curves
DASHBOARD_APP = ROOT / "dashboard" / "app.py"
EXAMPLES = ROOT / "examples"
