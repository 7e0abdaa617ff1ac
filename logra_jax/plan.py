"""Entry point: python -m logra_jax.plan --config=configs/<name>.py[:variant] --target=<chip:topology> [...].

Plans the whole job, phase by phase, compile-only for the target (logra_jax.planner.plan says how).
"""

import sys

from logra_jax.planner.plan import main

if __name__ == "__main__":
    sys.exit(main())
