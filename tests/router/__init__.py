"""The router (services/router/): its pure parts, end to end, and when a worker dies."""
