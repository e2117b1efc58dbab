"""Orchestration gke: the cluster (or an existing one), one TPU node pool per slice, the JobSet
of the slices' pods, its controllers and Kueue objects, and GKE's TPU topology table."""
