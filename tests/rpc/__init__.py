"""The shared RPC layer (bitdelta/rpc/, protos/): the server skeleton, protos, TLS and tokens, traces, metrics."""
