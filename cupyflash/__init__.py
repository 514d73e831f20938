"""cupyflash: runtime-compiled FlashAttention forward kernels for CuPy, PyTorch and JAX."""
from .config import DType
from .families.forward_sm80.config import FlashForwardKernelConfig
from .families.forward_sm80.config_sets import get_kernel_configs
from .api import forward
from .tuning import TuningTable
# The function shadows its module as a package attribute (`cupyflash.autotune(...)`, as documented);
# code that needs the module imports from it: `from cupyflash.autotune import format_table`.
from .autotune import autotune

__version__ = "0.1.0"

__all__ = ["DType", "FlashForwardKernelConfig", "TuningTable", "autotune", "forward", "get_kernel_configs",
           "__version__"]
