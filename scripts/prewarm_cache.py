#!/usr/bin/env python
"""Compile cupyflash kernels into a cache directory without a GPU (CI, container builds).

    python scripts/prewarm_cache.py --arch sm_80,sm_90 --set tune --cache-dir DIR --jobs N

A later GPU process with CUPYFLASH_CACHE_DIR=DIR loads these kernels without compiling.
Same as `python -m cupyflash prewarm ...`; the work is done by cupyflash.prewarm.
"""
import sys

from cupyflash.prewarm import main

if __name__ == "__main__":
    sys.exit(main())
