"""jax_flash: fused FlashAttention for JAX, as XLA FFI custom calls with CPU and CUDA kernels.

``jax_flash.dot_product_attention`` is a drop-in for ``jax.nn.dot_product_attention``. The CPU kernels are
always built. A CPU-only install (CUDA kernels not built) says so at import through the ``jax_flash`` logger at
level WARNING (printed to stderr unless logging is configured otherwise); CUDA kernels that are built while no GPU
is visible are reported at level INFO.
"""

import importlib.metadata
import logging

from jax_flash import _ffi
from jax_flash._ffi import force_kernel
from jax_flash.attention import dot_product_attention
from jax_flash.decode import combine, decode_attention
from jax_flash.reference import reference_attention
from jax_flash.ring import ring_attention, ring_attention_sharded, zigzag_order, zigzag_restore

__all__ = ["combine", "cuda_available", "decode_attention", "dot_product_attention", "force_kernel",
           "reference_attention", "ring_attention", "ring_attention_sharded", "zigzag_order", "zigzag_restore",
           "__version__"]

try:
    __version__ = importlib.metadata.version("jax_flash")
except importlib.metadata.PackageNotFoundError:
    __version__ = "0+unknown"


def cuda_available() -> bool:
    """True when the CUDA kernels are built, registered with JAX, and the CUDA runtime sees a GPU."""
    return _ffi.CUDA_REGISTERED and _ffi.cuda_device_count() > 0


def _report_cuda_status():
    logger = logging.getLogger(__name__)
    if not _ffi.CUDA_REGISTERED:
        logger.warning("jax_flash: %s; only the CPU kernels are available.", _ffi.CUDA_UNAVAILABLE_REASON)
    elif _ffi.cuda_device_count() == 0:
        logger.info("jax_flash: the CUDA kernels are built but no GPU is visible; the CPU kernels are available.")


_report_cuda_status()
