"""The environment each node's rank runs with, derived from the topology.

Every transport is pinned to the cabled QSFP port, so none can pick the management network
or fall back to a socket on another interface:

    NCCL_SOCKET_IFNAME           =<interfaces[0]>  NCCL bootstrap and socket transport ('=': exact name,
                                                   not a prefix)
    NCCL_IB_HCA                  =<rdma,rdma>      every RDMA device of the port, in interface order
                                                   (NCCL pairs devices by position across ranks)
    NCCL_IB_DISABLE              1                 only when the node lists no RDMA device
    UCX_NET_DEVICES              <interfaces[0]>
    OMPI_MCA_btl_tcp_if_include  <interfaces[0]>   MPI's own TCP traffic
    GLOO_SOCKET_IFNAME           <interfaces[0]>   gloo (CPU collectives, heartbeat)
    MASTER_ADDR / MASTER_PORT    rank 0's interfaces[0] address / rendezvous_port
"""

from __future__ import annotations

from collections.abc import Mapping

from hetero_run.topology.schema import Topology

NETWORK_VARS = (
    "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "UCX_NET_DEVICES",
    "OMPI_MCA_btl_tcp_if_include", "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT",
)


def node_environment(topology: Topology, index: int) -> dict[str, str]:
    """Variables for the rank on `topology.nodes[index]` (rank == index)."""
    node = topology.nodes[index]
    netdev = node.primary.name
    env = {
        "NCCL_SOCKET_IFNAME": f"={netdev}",
        "UCX_NET_DEVICES": netdev,
        "OMPI_MCA_btl_tcp_if_include": netdev,
        "GLOO_SOCKET_IFNAME": netdev,
        "MASTER_ADDR": topology.master_addr,
        "MASTER_PORT": str(topology.rendezvous_port),
    }
    if node.rdma_devices:
        env["NCCL_IB_HCA"] = "=" + ",".join(node.rdma_devices)
    else:
        env["NCCL_IB_DISABLE"] = "1"
    return {k: env[k] for k in NETWORK_VARS if k in env}


def all_environments(topology: Topology) -> list[dict[str, str]]:
    return [node_environment(topology, i) for i in range(len(topology.nodes))]


def shared_environment(topology: Topology) -> dict[str, str]:
    """Variables with the same value on every node: these can go on mpirun's command line (-x)."""
    envs = all_environments(topology)
    return {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}


def conflicts(env: Mapping[str, str], wanted: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(name, set value, topology value) for each variable already set to something else."""
    return [(k, env[k], v) for k, v in wanted.items() if k in env and env[k] != v]
