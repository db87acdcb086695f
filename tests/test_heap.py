"""Loading the first model freezes the interpreter's heap out of the cyclic collector's way,
once, without keeping anything alive (``multispec.api._freeze_heap``)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json, sys, weakref
import torch
from multispec import LLM
before = gc.get_freeze_count()
llm = LLM(sys.argv[1], device="cpu", dtype="float32")
first = gc.get_freeze_count()
model = weakref.ref(llm.model)
del llm
freed = model() is None
junk = [[] for _ in range(1000)]
second = LLM(sys.argv[1], device="cpu", dtype="float32")
print(json.dumps({"before": before, "first": first, "again": gc.get_freeze_count(), "freed": freed,
                  "tracked": len(gc.get_objects())}))
"""


def test_the_first_model_freezes_the_heap_once_and_frees_as_before(successor_dir):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(successor_dir)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["before"] == 0
    # torch's import alone leaves some 160,000 tracked objects; they are what the freeze moves.
    assert got["first"] > 100_000
    # Once per process: the second model does not freeze again (that would add its own objects and
    # the junk lists; the count only drops, by the first LLM's objects, freed).
    assert got["again"] <= got["first"]
    # Frozen, the first LLM is still freed when its last reference goes.
    assert got["freed"]
    # What came after the freeze is tracked (and collected) as usual: the junk lists, the second LLM.
    assert 1_000 < got["tracked"] < got["first"]
