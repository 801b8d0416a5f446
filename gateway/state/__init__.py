"""State shared by requests (and, through Redis, by replicas): the response cache, coalescing, rate
limits, the Redis link, the buffered-body and stream budgets."""
