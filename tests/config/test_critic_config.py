"""``critic.model`` in the config: one line where it cannot work, and a key a resume must keep."""

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
