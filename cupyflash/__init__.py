"""cupyflash: runtime-compiled FlashAttention kernels (prefill forward, varlen, KV-cache decode, backward) for CuPy, PyTorch and JAX."""
from .config import DType
from .families.forward_sm80.config import FlashForwardKernelConfig
from .families.forward_sm80.config_sets import get_kernel_configs
from .api import forward
from .backward_api import backward
from .backward_varlen import backward_varlen
from .families.backward_sm80 import BackwardKernelConfig
from .families.decode.config import DecodeKernelConfig
from .kvcache import forward_kvcache
from .varlen import forward_varlen
from .tuning import TuningTable
# The function shadows its module as a package attribute (`cupyflash.autotune(...)`, as documented);
# code that needs the module imports from it: `from cupyflash.autotune import format_table`.
from .autotune import autotune

__version__ = "0.1.0"

__all__ = ["BackwardKernelConfig", "DType", "DecodeKernelConfig", "FlashForwardKernelConfig", "TuningTable",
           "autotune", "backward", "backward_varlen", "forward", "forward_kvcache", "forward_varlen", "get_kernel_configs", "__version__"]
