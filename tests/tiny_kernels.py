"""Small hand-written CUDA sources for testing the compile/cache machinery without the real kernel.

Shaped like the real translation unit (a class-type non-type template parameter instantiated by
name expression), but compile in milliseconds.
"""

TINY_SOURCE = r"""
struct TinyConfig { int scale; bool enabled; };

template <TinyConfig C>
__global__ void tiny_kernel(float* x) {
    if (C.enabled) x[threadIdx.x] *= C.scale;
}
"""

TINY_NAMES = ("tiny_kernel<TinyConfig{2, true}>", "tiny_kernel<TinyConfig{3, false}>")

BROKEN_SOURCE = r"""
template <int N>
__global__ void broken_kernel(float* x) { x[0] = N }   // missing semicolon
"""


def tiny_source(variant: int) -> str:
    """A distinct source per `variant`, so each gets its own cache key."""
    return TINY_SOURCE + f"\n// variant {variant}\n"
