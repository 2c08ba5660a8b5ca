"""Process-wide test environment: set before torch/triton/nixl are imported anywhere."""

import os

# No GPU here: Triton kernels run in the interpreter (must be set before `import triton`).
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# NIXL/UCX between processes on this machine: loopback device, TCP kept for error handling.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp,self,sm")
