import pytest
from fake_device import FAKE_SIG


@pytest.fixture
def devices_asked(fake_h200, monkeypatch):
    """The device indexes tables were loaded for under ``fake_h200`` (the signature is asked per device)."""
    from hybridgemm.autotune_cache import signature

    asked = []
    monkeypatch.setattr(signature, "current_signature", lambda device_index=None: (asked.append(device_index),
                                                                                   dict(FAKE_SIG))[1])
    return asked
