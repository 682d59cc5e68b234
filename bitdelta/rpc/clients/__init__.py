"""Clients of the services, one per service, each with a deadline on every call.

Errors are `bitdelta.rpc.errors.RpcError` subclasses carrying the callee's
status code, so a service that re-raises them keeps the code for its caller.
"""
