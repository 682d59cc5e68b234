"""The GPU worker (services/gpu_worker/): its parts, the service, the process, the real model."""
