"""A stopping tenant service does not wait for a running pass: the stop points `tenant_service`
installs on the base's decoder layers cut every tenant's forward and backward passes short, through
the PEFT model the tenants' adapters are added to after them."""

import pytest

from graft.models.loading import load_model
from graft.parallel.abandon import Abandoned, stop_points
from graft.tenants.policy import Datum, TenantPolicy, TenantSpec


def test_a_tenants_pass_ends_at_the_next_layer_once_the_service_stops(base_dir):
    base = load_model(base_dir)
    stopping = stop_points(base)  # before any tenant: as tenant_service installs them
    policy = TenantPolicy(base)
    policy.add(TenantSpec("alice", rank=4, alpha=8, seed=1))
    datums = [Datum("alice", list(range(3, 15)), {"weights": [1.0] * 11})]
    policy.forward_backward(datums, "cross_entropy")
    stopping.set()
    with pytest.raises(Abandoned):
        policy.forward_backward(datums, "cross_entropy")
