"""The benchmarks' closing line on how long their threads waited for a core (``CoreWait``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_spec import CoreWait  # noqa: E402

from multispec.engine import costs  # noqa: E402


def test_a_benchmark_says_whether_the_machine_was_quiet_while_it_timed(monkeypatch):
    readings = [{"1": (0, 0)}, {"1": (10**9, 4 * 10**6), "2": (10**9, 0)}]  # 0.2% waited
    monkeypatch.setattr(costs, "core_wait", lambda: readings.pop(0))
    quiet = CoreWait().report()
    assert quiet == "this run's threads waited for a core 0.2% of the time they ran"
    readings += [{"1": (0, 0)}, {"1": (10**9, 3 * 10**8)}]  # 30% waited: above BUSY
    busy = CoreWait().report()
    assert busy.startswith("this run's threads waited for a core 30.0%") and "not the engine's" in busy
    readings += [None, None]
    assert "not known" in CoreWait().report()
