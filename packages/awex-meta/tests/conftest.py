import os
from pathlib import Path

import pytest
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


@pytest.fixture(scope="session")
def etcd_cluster():
    """Three real etcd members for the whole session (the etcd store's tests), or a skip saying why not."""
    from awex.meta.server.etcd_local import ETCD, MISSING, Cluster

    if ETCD is None:
        pytest.skip(f"{MISSING}: the etcd store cannot be tested here")
    cluster = Cluster()
    yield cluster
    cluster.close()
