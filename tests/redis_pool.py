"""The connection pool size of the tests' own Redis clients, set explicitly:
redis-py 8's async default (100) raises instead of waiting when it is full,
and no test needs more than a handful of connections at once."""

TEST_POOL_SIZE = 32
