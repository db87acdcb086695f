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
    """The default model in float32, loaded once for the whole session, on the CPU unless
    ``MULTISPEC_TEST_DEVICE`` names another device (the engine's tests then run there). Float32:
    the tests that compare token ids across batch shapes rely on its rounding being far below any
    real gap between logits (bfloat16 has its own tests)."""
    from multispec import LLM

    return LLM(device=os.environ.get("MULTISPEC_TEST_DEVICE", "cpu"), dtype="float32")


@pytest.fixture(scope="session")
def successor_dir(tmp_path_factory):
    """The tiny successor checkpoint (``tests.tiny_models``), written once per session."""
    from tests.tiny_models import write_successor_model

    directory = tmp_path_factory.mktemp("successor")
    write_successor_model(directory)
    return directory


@pytest.fixture(scope="session")
def tiny(successor_dir):
    """The tiny successor model on the CPU: engine behaviour that needs many steps or samples at
    microseconds a forward (context window 256, vocabulary 400)."""
    from multispec import LLM

    return LLM(str(successor_dir), device="cpu", dtype="float32")
