"""The fault suite: the runner, its case table and the ranks that play each case's faults."""
