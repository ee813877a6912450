#!/usr/bin/env python
"""The GPU measurements' old address, kept for tools that load this file: it is ``benchmarks/gpu/run.py``.

    PYTHONPATH=. python scripts/bench_gpu.py [args]     # the same as: python -m benchmarks.gpu.run [args]
"""

import sys

from benchmarks.gpu.run import (  # noqa: F401  (the names outside tools use)
    Results,
    _meta,
    kernels_section,
    longest_section,
    main,
    mfu_section,
    parse_args,
    schedule_section,
)

if __name__ == "__main__":
    sys.exit(main())
