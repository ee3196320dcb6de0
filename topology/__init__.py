"""Cluster description: hostfiles, YAML topologies, derived launch environment."""
