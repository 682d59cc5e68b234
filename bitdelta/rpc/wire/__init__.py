"""The constants of each service's protocol that its protos cannot state, one module per service
(`wire.delta_store`), imported by the service's server and by its client alike.

They sit here rather than beside the generated `bitdelta/<service>/v1/` modules because those
directories are build outputs (git-ignored, rewritten by `python -m bitdelta.protos_build`); the
RPC layer is torch-free and already shared by every server and client.
"""
