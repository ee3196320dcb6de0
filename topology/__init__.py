"""Cluster description: hostfiles, YAML topologies, derived launch environment.

    config.load_topology(path) -> schema.Topology     (nodes: Node with memory_gib, capacity_bytes, ...)
    hostfile.read_hostfile / write_hostfile / check_hostfile
    environment.node_environment(topology, rank)       NCCL / UCX / OpenMPI / gloo / MASTER_* variables
    fallback.fallback_decision(topology, world_size)   -> (tensor-parallel size, why single-node or None)
    checks.require_node_ready / node_checks            this host against its node
    reach.link_checks                                  the nodes reach each other over the configured link
    launch_command.mpirun_command                      the exact mpirun argv
"""
