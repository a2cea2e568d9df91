"""Pure tensor functions: scans, SSD, kernels, convolutions (no modules, no hooks)."""

from hooked.ops.conv import causal_conv1d
from hooked.ops.selective_scan import (
    linear_scan,
    mamba1_kernel,
    mamba1_kernel_discrete,
    mamba1_kernel_pairs,
    selective_scan,
    selective_scan_sequential,
)
from hooked.ops.ssd import (
    linear_scan_heads,
    mamba2_kernel,
    mamba2_kernel_pairs,
    segsum,
    segsum_naive,
    ssd_chunked,
    ssd_sequential,
    ssd_states,
)
