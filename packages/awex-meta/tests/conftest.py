import os
from pathlib import Path

from hypothesis import settings

# CI-sized, fixed budgets for property tests: deterministic (derandomized) so CI is reproducible.
settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("AWEX_HYPOTHESIS_EXAMPLES", "150")),
    deadline=None,
    derandomize=True,
    print_blob=True,
)
settings.load_profile("ci")

REPO = Path(__file__).resolve().parents[3]
MODELS = REPO / "integration" / "models"
