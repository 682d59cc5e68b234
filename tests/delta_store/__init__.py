"""The delta store (services/delta_store/): the backend contract, the cache policy, the service, shared memory."""
