"""Reward functions from the user's own file: loading, what they see, weights, and the errors."""

from __future__ import annotations

import sys

import pytest

from homerlhf.errors import UserError
from homerlhf.ppo.backends import RewardBackend
from homerlhf.ppo.reward_functions import (
    FunctionReward,
    RewardFunctionError,
    WeightedReward,
    component_metrics,
    load_reward_function,
)

USER_FILE = '''
SEEN = []

def everything(prompt, response, prompt_ids, response_ids, row):
    SEEN.append(dict(prompt=prompt, response=response, prompt_ids=prompt_ids, response_ids=response_ids, row=row))
    return float(len(response_ids))

def exact(response, row):
    return 1.0 if response.strip() == row["answer"] else 0.0

def maybe(response):
    return None if "skip" in response else 2

def loud(response, **kwargs):
    raise ValueError("no answer field")

def texty(response):
    return "high"

def nan(response):
    return float("nan")

def wants_x(response, x):
    return 0.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _ids(tokenizer, *texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_the_function_sees_texts_ids_and_the_row(user_file, tokenizer):
    fn = load_reward_function(f"{user_file}:everything")
    assert fn.args == ("prompt", "response", "prompt_ids", "response_ids", "row")
    prompts, responses = _ids(tokenizer, "What is 2 + 3?", "Tell me about tea."), _ids(tokenizer, "5", "Tea is nice.")
    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "Tell me about tea.", "topic": "tea"}]
    scores = FunctionReward(fn, tokenizer).score_samples(prompts, responses, rows)
    assert scores == [float(len(responses[0])), float(len(responses[1]))]
    seen = sys.modules[fn.fn.__module__].SEEN
    assert [s["prompt"] for s in seen] == ["What is 2 + 3?", "Tell me about tea."]
    assert [s["response"] for s in seen] == ["5", "Tea is nice."]
    assert [s["prompt_ids"] for s in seen] == prompts and [s["response_ids"] for s in seen] == responses
    assert [s["row"] for s in seen] == rows


def test_only_the_declared_arguments_are_passed(user_file, tokenizer):
    fn = load_reward_function(f"{user_file}:exact")
    assert fn.args == ("response", "row")
    scores = FunctionReward(fn, tokenizer).score_samples(
        _ids(tokenizer, "a", "b"), _ids(tokenizer, "42", "41"), [{"answer": "42"}, {"answer": "42"}])
    assert scores == [1.0, 0.0]


def test_the_file_is_imported_from_its_path_not_from_sys_path(tmp_path, tokenizer, monkeypatch):
    # A module of the same name earlier on sys.path must not be what runs.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "rewards.py").write_text("def score(response):\n    return -1.0\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "rewards.py").write_text("def score(response):\n    return 7.0\n")
    monkeypatch.syspath_prepend(str(shadow))
    fn = load_reward_function(f"{mine / 'rewards.py'}:score")
    assert FunctionReward(fn, tokenizer).score_samples(_ids(tokenizer, "p"), _ids(tokenizer, "r")) == [7.0]
    assert "rewards" not in sys.modules or sys.modules["rewards"].__file__ != str(mine / "rewards.py")


class _Constant(RewardBackend):
    def __init__(self, value):
        self.value = value

    def score(self, prompt_ids, response_ids):
        return [self.value] * len(prompt_ids)


def test_weights_combine_and_none_counts_as_zero(user_file, tokenizer):
    maybe = FunctionReward(load_reward_function(f"{user_file}:maybe"), tokenizer)
    total = WeightedReward([("rm", 0.5, _Constant(-3.0)), ("maybe", 2.0, maybe)])
    prompts, responses = _ids(tokenizer, "a", "b", "c"), _ids(tokenizer, "fine", "skip this", "ok")
    # 0.5 * -3 + 2 * 2 = 2.5; with None: 0.5 * -3 + 2 * 0 = -1.5
    assert total.submit_score(prompts, responses, [{}, {}, {}]).result() == [2.5, -1.5, 2.5]
    components = total.take_component_scores()
    assert components == {"rm": [-3.0, -3.0, -3.0], "maybe": [2.0, None, 2.0]}
    assert component_metrics(components) == {"reward_rm": -3.0, "reward_rm_none": 0.0,
                                             "reward_maybe": 2.0, "reward_maybe_none": pytest.approx(1 / 3)}
    assert total.take_component_scores() == {"rm": [], "maybe": []}  # taken once per iteration
    total.close()


@pytest.mark.parametrize("name, fragment", [
    ("loud", "reward function my_rewards.py:loud raised ValueError: no answer field on the sample with prompt "
             "'What is 17 + 25?' and response '42'"),
    ("texty", "reward function my_rewards.py:texty returned 'high' (str) on the sample with prompt "
              "'What is 17 + 25?' and response '42'; return a finite number, or None for no reward"),
    ("nan", "my_rewards.py:nan returned nan (float)"),
])
def test_a_failing_function_names_itself_and_the_sample(user_file, tokenizer, name, fragment):
    reward = FunctionReward(load_reward_function(f"{user_file}:{name}"), tokenizer)
    future = reward.submit_score(_ids(tokenizer, "What is 17 + 25?"), _ids(tokenizer, "42"), [{}])
    with pytest.raises(RewardFunctionError) as info:
        future.result()
    assert fragment in str(info.value) and "\n" not in str(info.value)
    reward.close()


@pytest.mark.parametrize("spec, fragment", [
    ("{dir}/none.py:score", "reward.function: file {dir}/none.py not found"),
    ("{file}:nope", "has no function 'nope' (it defines: everything, exact, loud, maybe, nan, texty, wants_x)"),
    ("{file}:NOT_A_FUNCTION", "my_rewards.py:NOT_A_FUNCTION is not a function (it is int)"),
    ("{file}:wants_x", "my_rewards.py:wants_x takes parameter 'x'; a reward function takes some of prompt, response"),
    ("{file}", "must look like path/to/file.py:function_name"),
    ("builtin:nope", "reward.function 'builtin:nope' is not a builtin reward function; choose one of: builtin:reverse, builtin:reverse-positions"),
    ("{dir}/broken.py:score", "importing {dir}/broken.py raised NameError: name 'undefined_name' is not defined"),
])
def test_loading_refuses_with_one_line(user_file, spec, fragment):
    (user_file.parent / "broken.py").write_text("x = undefined_name\n")
    fill = dict(dir=user_file.parent, file=user_file)
    with pytest.raises(UserError) as info:
        load_reward_function(spec.format(**fill))
    assert fragment.format(**fill) in str(info.value)


def test_builtin_reverse_rewards_load_from_the_package():
    exact, positions = load_reward_function("builtin:reverse"), load_reward_function("builtin:reverse-positions")
    assert exact.where == "builtin_reverse.py:reward" and set(exact.args) <= {"response", "row"}
    assert positions.where == "builtin_reverse.py:position_reward" and set(positions.args) <= {"response", "row"}


def test_a_sum_with_a_part_on_the_policys_modules_scores_in_the_callers_thread():
    """A reward on the policy's own modules (reward.backend adapter) must never run beside a policy
    forward: a weighted sum holding one scores in the caller's thread, one without in a thread of its own."""
    import threading

    from homerlhf.ppo.backends import CallableReward
    from homerlhf.ppo.reward_functions import WeightedReward

    threads = []

    class OnThePolicy(CallableReward):
        shares_policy = True

    def record(prompt, response):
        threads.append(threading.get_ident())
        return float(len(response))

    for part, same_thread in ((OnThePolicy(record), True), (CallableReward(record), False)):
        total = WeightedReward([("a", 2.0, part)])
        future = total.submit_score([[1]], [[5, 6, 7]])
        assert future.result() == [6.0]
        assert (threads[-1] == threading.get_ident()) == same_thread
        total.close()
