"""`multislice status` and `watch` for a stack whose orchestration is gke (the Kubernetes API)."""
