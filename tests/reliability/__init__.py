"""The reliability suite: the whole system as processes under faults, hostile clients and load."""
