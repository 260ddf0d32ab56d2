"""The libfabric and NCCL environment a job needs to run its collectives over an Elastic Fabric Adapter."""

from __future__ import annotations

# GPUDirect RDMA over EFA: NCCL moves GPU memory straight to the wire (p4d and later, Nitro v4+ P-types).
DEVICE_RDMA_FAMILIES = frozenset({"p4d", "p4de", "p5", "p5e", "p5en", "p6-b200"})


def supports_device_rdma(instance_type: str) -> bool:
    return instance_type.split(".", 1)[0] in DEVICE_RDMA_FAMILIES


def efa_environment(*, device_rdma: bool = False) -> dict[str, str]:
    """Variables for the job's processes when the instance has an EFA (AgentConfig.efa).

    From AWS's "Get started with EFA and NCCL" (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html)
    and the aws-ofi-nccl plugin the Deep Learning AMI ships (https://github.com/aws/aws-ofi-nccl):

    - FI_PROVIDER=efa: libfabric uses the EFA provider only, so a broken EFA fails the job's first collective
      instead of silently falling back to the much slower TCP provider.
    - FI_EFA_USE_DEVICE_RDMA=1 (only with `device_rdma`, see supports_device_rdma): GPUDirect RDMA reads and
      writes on the types whose EFA does RDMA; on the others libfabric refuses the setting.
    - FI_EFA_FORK_SAFE=1: the data loader forks its workers after NCCL registered memory with the EFA; this
      makes libfabric mark that memory so a forked child cannot corrupt it (newer libfabric detects the
      kernel's own support and ignores it, so it costs nothing there).

    Every network card: infra/efa.py attaches one EFA per card (the primary, with ENA and the IP, and EFA-only
    interfaces on the others). Nothing here names them: the aws-ofi-nccl plugin opens every EFA device
    libfabric reports and gives each GPU the ones nearest it on the PCIe tree, so NCCL's channels use all of
    them. NCCL_SOCKET_IFNAME is deliberately not set: NCCL's bootstrap skips `lo` and `docker*` and picks an
    interface with an address (EFA-only interfaces have none, so never those); pinning a name (ens5,
    enp...) would break on the types that name it differently.
    """
    environment = {"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1"}
    if device_rdma:
        environment["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return environment
