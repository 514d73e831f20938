#!/usr/bin/env python
"""The main job: one attention forward, timed and checked against an upcast reference.

    python scripts/run_attention.py [--batch 2 --seq 1024 --heads 16 --d-head 128 --dtype bf16 --config auto]

Same as `python -m cupyflash run ...`; the work is done by cupyflash.run_attention. On a machine
without a GPU it prints 'no CUDA GPU found: ...' and what it would have run, and exits 0.
"""
import sys

from cupyflash.run_attention import main

if __name__ == "__main__":
    sys.exit(main())
