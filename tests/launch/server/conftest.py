import pytest
from app_support import ScriptedEngine


@pytest.fixture
def engine():
    """The scripted engine: every request answered with its `pieces` (one token each), then `finish`."""
    return ScriptedEngine()
