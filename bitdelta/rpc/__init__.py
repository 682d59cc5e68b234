"""The one RPC layer the services share. Imports neither torch nor any service.

- `serve`: `create_server(address, services)` -> a `Server` with
  `grpc.health.v1`, reflection, ONE interceptor that answers domain exceptions
  with their status codes (`errors.status_of`), in-flight accounting and graceful drain;
  `run_until_signal` is the process lifecycle (SIGTERM -> NOT_SERVING ->
  in-flight calls finish within the grace period -> stop).
- `errors`: `ServiceError` (every service's errors: each class carries its
  status code), `RpcError` (a call to another service failed; its status code
  is kept across hops), `status_of`, message clipping.
- `config`: a typed, frozen dataclass -> command-line flags + environment
  variables + a start-up check with a clear error (`ServiceConfig`).
- `clients`: the delta store's, the worker's and the router's clients; a
  deadline on every call, errors as `RpcError` subclasses with their code.
- `checksums`: the crc32 of Fetch chunks.
- `receiver`: the one receiver of a delta's pieces (the store's client and the
  worker's loads): places them in a destination's buffers, checks every
  chunk's crc32 and each tensor's sha256 before handing a tensor over.
- `streams`: `take_ready`, how a server stream puts every token ready when it writes into
  one message (Generate, on the worker and the router).
- `wire`: each protocol's constants beyond its protos (the delta store's chunk
  limits, trailer key and shared-memory lease), shared by server and client.
"""
