"""Pure tensor functions: scans, SSD, the delta rule, kernels, convolutions (no modules, no hooks)."""

from hooked.ops.big_buffer import big_zeros
from hooked.ops.conv import causal_conv1d
from hooked.ops.delta_rule import (
    delta_rule_carry,
    delta_rule_chunked,
    delta_rule_sequential,
    delta_rule_step,
    l2norm,
)
from hooked.ops.delta_rule_kernel import (
    delta_rule_kernel,
    delta_rule_kernel_cols,
    delta_rule_kernel_pairs,
    delta_rule_kernel_rows,
    delta_rule_knockout,
)
from hooked.ops.fused import causal_conv1d_fused, selective_scan_fused, ssd_fused
from hooked.ops.scan_chunked import linear_scan_chunked, selective_scan_chunked
from hooked.ops.sdpa import sdpa_attention, visible_keys
from hooked.ops.selective_kernel import (
    mamba1_kernel_chunked,
    mamba1_kernel_cols,
    mamba1_kernel_discrete_chunked,
    mamba1_kernel_rows,
)
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
from hooked.ops.ssd_kernel import (
    mamba2_kernel_chunked,
    mamba2_kernel_cols,
    mamba2_kernel_discrete,
    mamba2_kernel_discrete_chunked,
    mamba2_kernel_rows,
)
