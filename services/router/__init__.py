"""The router: the public `Generate` and `ListModels` for the whole family (docs/router.md).

Built from the shared RPC layer (`bitdelta.rpc`), the generated protos and nothing else of the
project: it imports neither torch nor another service.
"""
