"""Device catalog: datasheet figures of accelerator types (pure Python, no JAX).

One entry is one device as JAX sees it (one ``jax.devices()`` entry): for a package of several dies
that the runtime exposes as separate GPUs, the entry is one die (``MI250X``: one GCD, half an OAM
package, 8 per node).

Used by :meth:`hethub_jax.planner.costs.DeviceCosts.from_catalog` when no profile of a device type
exists (DESIGN.md section 7). Every figure is the vendor's peak (dense, no sparsity), per device,
in SI units: FLOP/s, bytes, bytes/s (1 TB/s = 1e12 bytes/s; GB = 1e9 bytes; Gb/s network links are
divided by 8). Link bandwidths are per direction.

``intra_node_bandwidth`` is the device's scale-up link (NVLink, Infinity Fabric, HCCS, Gaudi's
scale-up RoCE ports) per direction; ``network_bandwidth`` is the scale-out NIC bandwidth per device in
the vendor's reference server (one 400 Gb/s NIC per GPU in DGX H100/H200/B200, 200 Gb/s in DGX A100,
...): a stated assumption about the cluster, not a property of the chip; a cluster spec may override
it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

__all__ = ["DeviceSpec", "CATALOG", "get_device", "mfu_not_applicable"]


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet figures of one accelerator type.

    Attributes:
      name: catalog key (``"H100-SXM"``).
      vendor: manufacturer.
      peak_flops: dense bf16 (fp16 where the vendor gives no bf16) matrix FLOP/s.
      memory_bytes: HBM capacity per device, bytes.
      memory_bandwidth: HBM bandwidth, bytes/s.
      intra_node_bandwidth: scale-up link bandwidth per device and direction, bytes/s.
      network_bandwidth: scale-out network bandwidth per device and direction, bytes/s.
      devices_per_node: devices of the vendor's reference node.
      source: datasheet title / URL of the figures (and notes on assumptions).
    """

    name: str
    vendor: str
    peak_flops: float
    memory_bytes: int
    memory_bandwidth: float
    intra_node_bandwidth: float
    network_bandwidth: float
    devices_per_node: int
    source: str

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


_T, _G = 1e12, 1e9

CATALOG: Dict[str, DeviceSpec] = {d.name: d for d in [
    DeviceSpec("A100-80GB", "NVIDIA", 312 * _T, 80 * 10**9, 2.039 * _T, 300 * _G, 25 * _G, 8,
               "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: BF16 312 TFLOPS dense, HBM2e 80 GB at "
               "2,039 GB/s, NVLink 600 GB/s bidirectional); network: DGX A100 user guide, one 200 Gb/s "
               "HDR InfiniBand NIC per GPU. https://www.nvidia.com/content/dam/en-zz/Solutions/"
               "Data-Center/a100/pdf/nvidia-a100-datasheet-nvidia-us-2188504-web.pdf"),
    DeviceSpec("H100-SXM", "NVIDIA", 989 * _T, 80 * 10**9, 3.35 * _T, 450 * _G, 50 * _G, 8,
               "NVIDIA H100 Tensor Core GPU datasheet (SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, "
               "HBM3 80 GB at 3.35 TB/s, NVLink 900 GB/s bidirectional); network: DGX H100, one 400 Gb/s "
               "ConnectX-7 per GPU. https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    DeviceSpec("H200", "NVIDIA", 989 * _T, 141 * 10**9, 4.8 * _T, 450 * _G, 50 * _G, 8,
               "NVIDIA H200 Tensor Core GPU datasheet (SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, "
               "HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s bidirectional); network: HGX H200, one 400 Gb/s "
               "NIC per GPU. https://www.nvidia.com/en-us/data-center/h200/"),
    DeviceSpec("B200", "NVIDIA", 2250 * _T, 180 * 10**9, 8.0 * _T, 900 * _G, 50 * _G, 8,
               "NVIDIA DGX B200 datasheet / HGX B200 (1,000 W): BF16 4.5 PFLOPS with sparsity = 2.25 dense "
               "per GPU, 1,440 GB HBM3e per 8 GPUs = 180 GB at 8 TB/s, NVLink 5 1.8 TB/s bidirectional; "
               "network: one 400 Gb/s ConnectX-7 per GPU. https://www.nvidia.com/en-us/data-center/dgx-b200/"),
    DeviceSpec("MI250X", "AMD", 191.5 * _T, 64 * 10**9, 1.6384 * _T, 200 * _G, 12.5 * _G, 8,
               "ONE GCD (graphics compute die) of an AMD Instinct MI250X, the device JAX on ROCm sees: the OAM "
               "package holds two GCDs, each its own GPU (OLCF Frontier User Guide: 'the 8 GCDs contained in "
               "the 4 MI250X will show as 8 separate GPUs', each with 64 GB HBM2E, "
               "https://docs.olcf.ornl.gov/systems/frontier_user_guide.html). Per GCD, half the package's "
               "datasheet figures (AMD Instinct MI250X datasheet: BF16 383 TFLOPS dense, HBM2e 128 GB at "
               "3.2768 TB/s per OAM, https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html): "
               "BF16 191.5 TFLOPS, 64 GB at 1.6384 TB/s ('1.6 TB/sec per GCD', ROCm docs, AMD Instinct MI250 "
               "microarchitecture, https://rocm.docs.amd.com/en/latest/conceptual/gpu-arch/mi250.html). "
               "Scale-up: the two GCDs of a package are linked by 4 Infinity Fabric links of 50 GB/s, 200 GB/s "
               "per direction (ROCm docs, same page; Frontier guide: 200 GB/s); links to GCDs of other "
               "packages are 50-100 GB/s (1-2 links), so a ring over more than the 2 GCDs of one package is "
               "slower than this figure (optimistic there; a cluster spec may set intra_node_bandwidth). "
               "8 GCDs per node (HPE Cray EX235a, Frontier: 4 MI250X). Network: one 200 Gb/s Slingshot NIC "
               "per MI250X package (4 per Frontier node) = 25 GB/s per package = 12.5 GB/s per GCD."),
    DeviceSpec("MI300X", "AMD", 1307.4 * _T, 192 * 10**9, 5.3 * _T, 448 * _G, 50 * _G, 8,
               "AMD Instinct MI300X datasheet (BF16 1,307.4 TFLOPS dense, HBM3 192 GB at 5.3 TB/s, 7 "
               "Infinity Fabric links, 896 GB/s aggregate peak, taken as 448 GB/s per direction); network: "
               "one 400 Gb/s NIC per GPU in the AMD Instinct MI300X platform. "
               "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
    DeviceSpec("MI325X", "AMD", 1307.4 * _T, 256 * 10**9, 6.0 * _T, 448 * _G, 50 * _G, 8,
               "AMD Instinct MI325X datasheet (BF16 1,307.4 TFLOPS dense, HBM3E 256 GB at 6 TB/s, Infinity "
               "Fabric 896 GB/s aggregate, taken as 448 GB/s per direction); network: one 400 Gb/s NIC per "
               "GPU. https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html"),
    DeviceSpec("Gaudi3", "Intel", 1835 * _T, 128 * 10**9, 3.67 * _T, 525 * _G, 75 * _G, 8,
               "R. Kaplan, 'Intel Gaudi 3 AI Accelerator: Architected for Gen AI Training and Inference', "
               "Hot Chips 2024, and the Intel Gaudi 3 AI Accelerator white paper (BF16 matrix 1,835 TFLOPS, "
               "HBM2e 128 GB at 3.67 TB/s, 24 x 200 GbE RoCE: in the HLS-Gaudi3 baseboard 21 ports scale-up "
               "= 525 GB/s, 3 ports scale-out = 75 GB/s per direction)."),
    DeviceSpec("Ascend910B", "Huawei", 320 * _T, 64 * 10**9, 1.6 * _T, 196 * _G, 25 * _G, 8,
               "Huawei publishes no per-chip 910B datasheet; figures as reported for the Atlas 800T A2 "
               "server (8 x 910B): FP16 about 320 TFLOPS per chip (reports range 280-376 by bin), HBM2e "
               "64 GB at about 1.6 TB/s, HCCS 392 GB/s aggregate (taken as 196 GB/s per direction), one "
               "200 Gb/s RoCE port per NPU. Treat as +-20%; profile the device when possible. "
               "https://e.huawei.com/en/products/computing/ascend"),
    DeviceSpec("cpu", "any", 50 * _G, 16 * 10**9, 10 * _G, 5 * _G, 1 * _G, 1,
               "Stated assumption for this project's CPU islands (2 shared x86 cores, fp32 AVX2 FMA at "
               "about 2.5 GHz: 2 x 2.5e9 x 32 = 160 GFLOP/s peak, 50 GFLOP/s taken as a fake device's "
               "share), 16 GB memory, 10 GB/s memory bandwidth, host copies at 5 GB/s, 1 GB/s between "
               "processes. Always prefer a profile (python -m hethub_jax.profile) for cpu islands."),
]}


def get_device(name: str) -> DeviceSpec:
    """The catalog entry ``name`` (exact key, or the key compared case-insensitively without ``-``/``_``).

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    if name in CATALOG:
        return CATALOG[name]
    norm = lambda s: s.lower().replace("-", "").replace("_", "").replace(" ", "")
    for k, v in CATALOG.items():
        if norm(k) == norm(name):
            return v
    raise ValueError(f"unknown device type {name!r}; known: {sorted(CATALOG)}")


def mfu_not_applicable(plan: Any) -> Optional[str]:
    """Why model FLOPs utilisation would mislead for ``plan`` (a ``parallel.plan.Plan``), or None.

    MFU divides achieved model FLOP/s by the devices' datasheet peak. A ``cpu`` island has no datasheet
    peak (the catalog's ``cpu`` entry is this project's assumption), and EMULATED slowdowns exist only on
    cpu islands, so a plan with any cpu island gets ``"n/a (CPU, no peak)"`` (``None`` in JSON)."""
    if any(i.platform == "cpu" for i in plan.islands):
        return "n/a (CPU, no peak)"
    return None
