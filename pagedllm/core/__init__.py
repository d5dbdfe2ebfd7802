"""Memory policy in plain Python, no torch: the block pool, block tables, the scheduler and its step plan."""
