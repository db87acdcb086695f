import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("MULTISPEC_NO_PROGRESS", "1")
# A fresh model cache per test session: the GGUF conversion is exercised every run, once, and
# shared by every test and CLI subprocess of the session.
_CACHE = tempfile.mkdtemp(prefix="multispec-test-cache-")
os.environ["MULTISPEC_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)


@pytest.fixture(scope="session")
def llm():
    """The default model, loaded once for the whole session, on the CPU unless
    ``MULTISPEC_TEST_DEVICE`` names another device (the engine's tests then run there)."""
    from multispec import LLM

    return LLM(device=os.environ.get("MULTISPEC_TEST_DEVICE", "cpu"))
