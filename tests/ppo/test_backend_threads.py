"""Where reward backends compute: in a worker thread beside the trainer, or in the caller's thread."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture(scope="module")
def tiny_rm_dir(tiny_llama_dir, tmp_path_factory):
    """A tiny reward model (random score head) saved as an HF sequence-classification dir."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-rm")
    model = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1)
    model.config.pad_token_id = 0
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(out)
    return out


PROMPTS, RESPONSES = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]


def _threads_of(module) -> list[int]:
    seen: list[int] = []
    module.register_forward_pre_hook(lambda *_: seen.append(threading.get_ident()))
    return seen


def test_an_in_process_reward_model_on_the_cpu_scores_in_the_callers_thread(tiny_rm_dir):
    """On the CPU a scoring thread beside the trainer only contends for its cores (docs/time.md)."""
    from homerlhf.ppo.backends import HFReward

    rm = HFReward(str(tiny_rm_dir), device="cpu")
    seen = _threads_of(rm.model.get_input_embeddings())
    future = rm.submit_score(PROMPTS, RESPONSES)
    assert rm.on_trainer_cpu and future.done() and set(seen) == {threading.get_ident()}
    assert future.result() == pytest.approx(rm.score(PROMPTS, RESPONSES), abs=1e-6)
    rm.close()


def test_a_weighted_sum_with_a_cpu_model_scores_inline_and_a_function_alone_in_a_thread(tiny_rm_dir):
    from homerlhf.ppo.backends import CallableReward, HFReward
    from homerlhf.ppo.reward_functions import WeightedReward

    fn_threads: list[int] = []

    def length(prompt, response):
        fn_threads.append(threading.get_ident())
        return float(len(response))

    alone = CallableReward(length)
    assert not alone.on_trainer_cpu
    assert alone.submit_score(PROMPTS, RESPONSES).result() == [2.0, 3.0]
    assert fn_threads and threading.get_ident() not in fn_threads  # overlaps the trainer
    alone.close()

    fn_threads.clear()
    rm = HFReward(str(tiny_rm_dir), device="cpu")
    both = WeightedReward([("rm", 1.0, rm), ("length", 0.5, CallableReward(length))])
    future = both.submit_score(PROMPTS, RESPONSES)
    assert both.on_trainer_cpu and future.done() and set(fn_threads) == {threading.get_ident()}
    expected = [r + 0.5 * n for r, n in zip(rm.score(PROMPTS, RESPONSES), [2.0, 3.0])]
    assert future.result() == pytest.approx(expected, abs=1e-6)
