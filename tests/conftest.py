import pyro
import pytest


@pytest.fixture(autouse=True)
def fresh_pyro_state():
    """PyroModule parameters live in Pyro's global param store: clear it so tests do not share parameters."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()
