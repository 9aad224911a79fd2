"""Deployments beyond one host: the Ray Serve config, Kubernetes manifests, the EKS cluster."""
