"""Side-by-side answers: the trained actor (a checkpoint's ``actor`` adapter) and the reference (the
same base with the adapter off) or another checkpoint's actor on the same base (``right``: e.g. the
checkpoint a DPO run started from), on the same prompt, sampling settings and seed, each scored by a
reward model.

The base is loaded the way training loads it (:func:`homerlhf.models.policy.load_base`, 4-bit when
the run is), so the reference here is exactly the training reference when ``ref.backend`` is
``adapter_off``, and the weights the llama.cpp reference was exported from otherwise.

The reward model is the caller's: a function of ``(cfg, tokenizer)`` returning anything with
``score(prompt_ids, response_ids)`` and ``close()`` (a ``homerlhf.ppo.backends.RewardBackend``), e.g.
``homerlhf.stages.scorers.scoring_reward``; the app's reuses a running run's own worker.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError


@dataclass
class Answer:
    text: str
    prompt_ids: list[int]
    response_ids: list[int]  # up to and including the first stop token, as the trainer scores them
    score: Optional[float] = None


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def answer_text(tokenizer, response_ids: list[int], stop_ids) -> str:
    """The answer's text, decoded as one sequence. An answer cut by the token cap can end inside a
    character made of several bytes (several byte tokens); that partial character is left out rather
    than shown as a replacement mark. Bytes the model sampled that form no character anywhere else stay
    visible as U+FFFD: they are what it produced."""
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    if not text.endswith("\ufffd") or (response_ids and response_ids[-1] in stop_ids):
        return text.strip()
    for cut in range(1, min(4, len(response_ids)) + 1):  # a UTF-8 character is at most 4 bytes
        shorter = tokenizer.decode(response_ids[:-cut], skip_special_tokens=True)
        if not shorter.endswith("\ufffd"):
            return shorter.strip()
    return text.strip()


RIGHT = "right"  # the adapter name of the checkpoint compared on the right


class EvalModels:
    """One run checkpoint loaded for chatting: base + ``actor`` adapter, tokenizer, reward model.

    ``cfg``: the run's config; ``reward``: builds the reward model from ``(cfg, tokenizer)``
    (None: answers go unscored); ``right``: another checkpoint of the same base whose actor answers on
    the right (None: the base with the adapter off).
    """

    def __init__(self, cfg: RunConfig, checkpoint: str | Path,
                 reward: Optional[Callable[[RunConfig, Any], Any]] = None, right: Optional[str | Path] = None):
        from peft import PeftModel

        from homerlhf.config import check_device
        from homerlhf.models.generation import stop_token_ids
        from homerlhf.models.policy import ACTOR, load_base, load_tokenizer
        from homerlhf.models.registry import resolve_model

        self.checkpoint = Path(checkpoint)
        check_device(cfg)
        adapter_dir = self.checkpoint / ACTOR
        if not (adapter_dir / "adapter_config.json").is_file():
            raise UserError(f"checkpoint {self.checkpoint} has no '{ACTOR}' adapter; pick another checkpoint")
        self.cfg = cfg
        model_path = resolve_model(cfg.model.name_or_path)
        self.tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.model.trust_remote_code,
                                        revision=cfg.model.revision)
        base = load_base(model_path, cfg)
        self.stop_ids = stop_token_ids(self.tokenizer, base.generation_config)
        self.model = PeftModel.from_pretrained(base, str(adapter_dir), adapter_name=ACTOR)
        self.right = Path(right) if right else None
        if self.right is not None:
            if not (self.right / ACTOR / "adapter_config.json").is_file():
                raise UserError(f"checkpoint {self.right} has no '{ACTOR}' adapter; compare with another checkpoint")
            self.model.load_adapter(str(self.right / ACTOR), adapter_name=RIGHT)
        self.model.set_adapter(ACTOR)
        self.model.eval()
        self.reward = reward(cfg, self.tokenizer) if reward is not None else None
        # Generation mutates no weights, but peft's adapter switch is global to the model.
        self.lock = threading.Lock()

    @property
    def device(self):
        return next(self.model.parameters()).device

    def prompt_ids(self, text: str) -> list[int]:
        """The message as a prompt of at most ``rollout.max_prompt_len`` ids, a long one keeping its
        head (:func:`homerlhf.data.tokens.fit_prompt`), as in training."""
        from homerlhf.data.tokens import fit_prompt

        limit = self.cfg.rollout.max_prompt_len
        ids = fit_prompt(self.tokenizer, [{"role": "user", "content": text}], limit)
        if ids is None:
            raise UserError(f"the chat template alone is longer than rollout.max_prompt_len={limit} tokens; raise it")
        return ids

    def _side(self, adapter_on: bool | str):
        """The block's model: the actor (True), the base with adapters off (False), or the adapter named."""
        import contextlib

        from homerlhf.models.policy import ACTOR

        if adapter_on is False:
            return self.model.disable_adapter()
        name = ACTOR if adapter_on is True else adapter_on

        @contextlib.contextmanager
        def switched():
            self.model.set_adapter(name)
            try:
                yield
            finally:
                self.model.set_adapter(ACTOR)

        return switched()

    def _generate(self, prompt: list[int], sampling: Sampling, adapter_on: bool | str) -> list[int]:
        """Response ids up to and including the first stop token: the shape PPO and its reward
        model score (:func:`homerlhf.data.replies.reward_sequence_ids`). ``adapter_on``: see :meth:`_side`."""
        import torch

        from homerlhf.models.generation import build_generation_config, checkpoint_defaults_off

        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        config = build_generation_config(max_new_tokens=int(sampling.max_new_tokens),
                                         temperature=float(sampling.temperature), stop_ids=self.stop_ids,
                                         pad_id=self.tokenizer.pad_token_id)
        # A chat may sample from a cut distribution; nothing else of the checkpoint's config applies.
        config.top_p, config.top_k = float(sampling.top_p), int(sampling.top_k)
        # Same seed for both sides: differences come from the weights, not the dice.
        torch.manual_seed(int(sampling.seed))
        with torch.no_grad(), self._side(adapter_on), checkpoint_defaults_off(self.model.get_base_model(), config):
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        response = out[0, ids.shape[1]:].tolist()
        ends = [i for i, token in enumerate(response) if token in self.stop_ids]
        return response[: ends[0] + 1] if ends else response

    def answer_both(self, text: str, sampling: Sampling) -> tuple[Answer, Answer]:
        """(actor answer, right answer: the reference's, or the ``right`` checkpoint's) to one user
        message, each with its reward score."""
        if not text.strip():
            raise UserError("type a message first")
        prompt = self.prompt_ids(text)
        with self.lock:
            actor_ids = self._generate(prompt, sampling, adapter_on=True)
            ref_ids = self._generate(prompt, sampling, adapter_on=RIGHT if self.right is not None else False)
        answers = [Answer(answer_text(self.tokenizer, r, self.stop_ids), prompt, r) for r in (actor_ids, ref_ids)]
        if self.reward is not None:
            scores = self.reward.score([prompt, prompt], [actor_ids, ref_ids])
            for answer, score in zip(answers, scores):
                answer.score = float(score)
        return answers[0], answers[1]

    def answer_actor(self, text: str, sampling: Sampling) -> Answer:
        """One more answer of the actor alone (a draft to pick from), scored like the others."""
        prompt = self.prompt_ids(text)
        with self.lock:
            ids = self._generate(prompt, sampling, adapter_on=True)
        answer = Answer(answer_text(self.tokenizer, ids, self.stop_ids), prompt, ids)
        if self.reward is not None:
            answer.score = float(self.reward.score([prompt], [ids])[0])
        return answer

    def _generate_many(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int],
                       adapter_on: bool) -> list[list[int]]:
        """Response ids per prompt, each up to and including its first stop token, from one batched
        generate in which row ``i`` samples with its own generator seeded ``seeds[i]``."""
        import contextlib

        import torch

        from homerlhf.models.generation import build_generation_config, checkpoint_defaults_off
        from homerlhf.models.sampling import PerSampleSampler

        width = max(len(p) for p in prompts)  # left padding: generation continues from the last column
        ids = torch.tensor([[self.tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts],
                           dtype=torch.long, device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        config = build_generation_config(max_new_tokens=int(sampling.max_new_tokens),
                                         temperature=float(sampling.temperature), stop_ids=self.stop_ids,
                                         pad_id=self.tokenizer.pad_token_id)
        sampler = PerSampleSampler(seeds, sampling.temperature, self.device)
        ctx = contextlib.nullcontext() if adapter_on else self.model.disable_adapter()
        with torch.no_grad(), ctx, checkpoint_defaults_off(self.model.get_base_model(), config):
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                      logits_processor=[sampler])
        responses = []
        for row in out[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token in self.stop_ids]
            responses.append(row[: ends[0] + 1] if ends else row)
        return responses

    def answer_many(self, texts: list[str], sampling: Sampling,
                    seeds: list[int]) -> list[tuple[Answer, Answer]]:
        """(actor answer, reference answer) to each message, from one batched generate per side.

        Row ``i`` of both sides samples from a generator seeded ``seeds[i]``
        (:class:`homerlhf.models.sampling.PerSampleSampler`), so an answer depends on its own message
        and seed only, not on the other messages, and the two sides differ by the weights alone.
        Full-distribution sampling only: ``top_p`` 1 and ``top_k`` 0.
        """
        if len(seeds) != len(texts):
            raise ValueError(f"{len(texts)} messages but {len(seeds)} seeds")
        if sampling.top_p < 1.0 or sampling.top_k > 0:
            raise ValueError("answer_many samples the full distribution: top_p must be 1 and top_k 0")
        prompts = [self.prompt_ids(text) for text in texts]
        with self.lock:
            sides = [self._generate_many(prompts, sampling, seeds, adapter_on=on) for on in (True, False)]
        pairs = [tuple(Answer(answer_text(self.tokenizer, r, self.stop_ids), p, r) for r in rs)
                 for p, rs in zip(prompts, zip(*sides))]
        if self.reward is not None:
            for start in range(0, len(pairs), 16):  # a reward call per 32 sequences, as a PPO chunk
                chunk = pairs[start:start + 16]
                scores = self.reward.score([a.prompt_ids for pair in chunk for a in pair],
                                           [a.response_ids for pair in chunk for a in pair])
                for answer, score in zip([a for pair in chunk for a in pair], scores):
                    answer.score = float(score)
        return pairs

    def close(self) -> None:
        if self.reward is not None:
            self.reward.close()
