"""Why the published task ``schwarzschild-orbit`` (TB2 layout, purple29th-tbench-2) is classed
``task`` in ``tools/tb_corpus_reasons.yaml``: four of its tests expect ``timeout`` for orbits that
must be captured.

For a timelike geodesic of Schwarzschild mass M with conserved energy E and angular momentum L
(per unit mass), the radial equation is (dr/dtau)^2 = E^2 - V(r) with V(r) = (1 - 2M/r)(1 + L^2/r^2)
(Misner, Thorne & Wheeler, *Gravitation*, eq. 25.16; the same in Kerr-Schild coordinates, which
differ only in t). A particle starting at r0 with dr/dtau = 0 falls inwards unless V has a turning
point in (2M, r0); for L < 2*sqrt(3)*M V has no extremum at all (the innermost stable orbit's L),
so it is captured. This script reads the task's own ``config``/``invariants`` helpers from its
tests/test_outputs.py and prints, for each test that asserts ``timeout``, E, L/M and the inner
turning point (None: captured is the physical answer).

Run: ``python tools/tb_schwarzschild_check.py TASK_DIR`` (the task folder; nothing is executed but
its test module's helpers, imported with a stand-in ``pytest`` module).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import types
from pathlib import Path

TIMEOUT_CASES = {  # test name -> its config(M, d_tau, tau_max, R0, vx, vy, vz), as in the task's tests
    "test_conserves_bound": (1.0, 0.8, 100.0, 10.0, 0.0, 0.30, 0.02),
    "test_off_equatorial": (1.0, 0.8, 100.0, 10.0, 0.1, 0.25, 0.15),
    "test_nonunit_mass": (2.0, 0.8, 80.0, 12.0, 0.0, 0.32, 0.04),
    "test_polar": (1.0, 0.8, 80.0, 9.0, 0.0, 0.05, 0.32),
}


def inner_turning_point(E: float, L: float, M: float, r0: float, steps: int = 200_000) -> float | None:
    """Largest r in (2M, r0) with E^2 < V(r) (a barrier the infall stops at), or None (captured)."""
    for i in range(steps - 1, 0, -1):
        r = 2 * M + (r0 - 2 * M) * i / steps
        if E * E - (1 - 2 * M / r) * (1 + L * L / (r * r)) < 0:
            return r
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("task", type=Path, help="the schwarzschild-orbit task folder")
    args = p.parse_args(argv)
    source = args.task / "tests" / "test_outputs.py"
    if not source.is_file():
        p.error(f"{source} not found: pass the schwarzschild-orbit task folder")
    sys.modules.setdefault("pytest", types.ModuleType("pytest"))
    spec = importlib.util.spec_from_file_location("schwarzschild_tests", source)
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    for name, case in TIMEOUT_CASES.items():
        cfg = tests.config(*case)
        M, r0 = case[0], case[3]
        inv = tests.invariants(cfg["initial_position"], cfg["initial_velocity"], M)
        E, L = inv["E"], math.sqrt(inv["L2"])
        turn = inner_turning_point(E, L, M, r0)
        print(f"{name}: E={E:.5f} L/M={L / M:.4f} (bound orbits need L/M >= {2 * math.sqrt(3):.4f}); "
              f"inner turning point: {'none, captured' if turn is None else f'r={turn:.3f}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
