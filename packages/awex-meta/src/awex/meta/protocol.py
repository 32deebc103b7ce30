"""What the MetaServer and its clients agree on beyond JSON bodies: header names (no aiohttp needed here)."""

EPOCH_HEADER = "X-Awex-Epoch"  # a random name of the server process, on every answer: changes on restart
FENCE_HEADER = "X-Awex-Fence"  # a writer's "<epoch>:<identity>": refused once a newer writer of it took over
REQUEST_ID_HEADER = "X-Awex-Request-Id"  # a write's id: a retry with the same id is answered, not applied again
