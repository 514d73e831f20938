"""cupyflash: runtime-compiled FlashAttention forward kernels for CuPy, PyTorch and JAX."""
from .config import DType, FlashForwardKernelConfig
from .config_sets import get_kernel_configs

__version__ = "0.1.0"

__all__ = ["DType", "FlashForwardKernelConfig", "get_kernel_configs", "__version__"]
