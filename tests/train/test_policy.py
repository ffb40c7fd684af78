"""The optimizer the policy builds: the weight decay AdamW is given (the schedule's rates:
tests/train/test_lr_schedule.py)."""

from graft.config import load_config


def test_adamw_decays_the_lora_parameters_by_the_configured_weight(base_dir, tmp_path):
    from graft.parallel.dist import Dist
    from graft.train.policy import PolicyState

    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference", "train.weight_decay=0.25",
                                "lora.rank=4"])
    policy = PolicyState(config, tmp_path, Dist(), pad_id=0, resume=False)
    assert {group["weight_decay"] for group in policy.optimizer.param_groups} == {0.25}
