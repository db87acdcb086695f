import os

import pytest

os.environ.setdefault("MULTISPEC_NO_PROGRESS", "1")


@pytest.fixture(scope="session")
def llm():
    """The default model, loaded once for the whole session (converted from GGUF on first use)."""
    from multispec import LLM

    return LLM()
