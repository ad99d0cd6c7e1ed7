"""``critic.model`` and ``critic.warmup_iterations`` in the config: one line where they cannot work, and a key
a resume must keep."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.errors import UserError


@pytest.mark.parametrize("overrides, fragment", [
    (["critic.model=some/critic", "critic.shared_adapter=true"],
     "critic.model (some/critic) gives the critic a base of its own, and critic.shared_adapter puts it in the actor's "
     "adapter; set critic.shared_adapter=false or unset critic.model"),
    (["critic.model=some/critic", "algorithm=grpo", "group.size=2"],
     "algorithm grpo trains none; unset critic.model or set algorithm=ppo"),
    (["critic.warmup_iterations=2", "critic.shared_adapter=true"],
     "critic.warmup_iterations (2) trains the critic alone, and critic.shared_adapter puts it in the actor's adapter; "
     "set critic.shared_adapter=false or critic.warmup_iterations=0"),
    (["critic.warmup_iterations=2", "algorithm=rloo", "group.size=2"],
     "critic.warmup_iterations warms up PPO's critic, and algorithm rloo trains none; set critic.warmup_iterations=0 "
     "or algorithm=ppo"),
    (["critic.warmup_iterations=-1"], "critic.warmup_iterations"),
])
def test_a_critic_model_where_it_cannot_work_is_one_line(overrides, fragment):
    with pytest.raises(UserError) as err:
        load_config("cpu-tiny", None, overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_resume_keeps_the_critic_model():
    from homerlhf.ppo.checkpoint import incompatible_difference

    on_base, own = load_config("cpu-tiny"), load_config("cpu-tiny", None, ["critic.model=some/critic"])
    assert own.critic.model == "some/critic" and on_base.critic.model is None
    assert incompatible_difference(on_base, own) == ("critic.model", None, "some/critic")
