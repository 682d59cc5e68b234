"""deploy/: the compose file, the Kubernetes manifests, the images' pins."""
