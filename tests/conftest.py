import pyro
import pytest
import torch

# The test models are small: one intra-op thread is as fast as two, and it keeps tiny ops from slowing down by
# orders of magnitude when the machine is shared (oversubscribed thread pools spin).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_pyro_state():
    """PyroModule parameters live in Pyro's global param store: clear it so tests do not share parameters."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()
