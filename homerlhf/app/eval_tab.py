"""The Evaluate tab: chat with the trained actor and the reference side by side, see the reward
model's score under each answer, and record which is better: the human feedback loop closes here.

Each message is a fresh single-turn prompt for both models (so every judgement is one
prompt/chosen/rejected record); the chat windows keep the history for reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homerlhf.app import chat, preferences, runs
from homerlhf.app.common import guarded
from homerlhf.errors import UserError

LEFT_LABEL = "Actor (trained adapter)"
RIGHT_LABEL = "Reference (adapter off)"


def checkpoint_choices(run_dir: str) -> list[tuple[str, str]]:
    """(label, path) of the run's checkpoints, newest first; one whose actor adapter is not what its
    manifest recorded is marked with why (Send refuses it)."""
    from homerlhf.ppo.checkpoint import POLICY_FILES

    states = runs.checkpoint_states(run_dir, POLICY_FILES) if run_dir else []
    return [(runs.checkpoint_label(p.name, problem), str(p)) for p, problem in states]


def default_checkpoint(choices: list[tuple[str, str]]):
    """The newest checkpoint not marked unusable (else the newest; None for none)."""
    usable = [path for label, path in choices if label == Path(path).name]
    return (usable or [path for _, path in choices] or [None])[0]


def score_markdown(answer: chat.Answer) -> str:
    return "reward score: n/a" if answer.score is None else f"reward score: **{answer.score:+.4f}**"


def counts_markdown(run_dir: str) -> str:
    """What has been recorded so far, and (once there is a pair) how to train on it."""
    pairs, ties = preferences.count(run_dir)
    ties_text = f"{ties} tie(s) in `{preferences.TIES_FILE}`"
    if not pairs:
        return f"No preference pair yet (a tie is no pair); {ties_text}."
    path = Path(run_dir) / preferences.PAIRS_FILE
    return (f"{pairs} preference pair(s) in `{path}`, {ties_text}. "
            f"Train a reward model on them: `homerlhf reward --data {path}`; {preferences.held_out_note(pairs)}.")


def kl_so_far(run_dir: str) -> str:
    """The run's last logged KL to the reference, in words ('' when none is logged)."""
    from homerlhf.app.monitor import read_jsonl

    rows = [r for r in read_jsonl(Path(run_dir) / runs.METRICS_FILE) if isinstance(r.get("kl_mean"), (int, float))]
    if not rows:
        return ""
    kl = round(rows[-1]["kl_mean"], 4) + 0.0  # + 0.0: -0.0 reads as 0.0000
    return f"KL to the reference so far: {kl:.4f} nats per response at iteration {rows[-1].get('iteration', len(rows))}"


def identical_markdown(run_dir: str, seed: int) -> str:
    kl = kl_so_far(run_dir)
    return (f"**The two answers are identical** (seed {seed}): on this prompt the trained actor still samples "
            "what the reference does, so the policy has not moved here" + (f" ({kl})" if kl else "") + ". "
            "Identical answers make no preference pair, so *Left/Right better* are off: press *Resample* for "
            "another seed, or record a *Tie*.")


@dataclass
class EvalPanel:
    """The tab's components: run and checkpoint, sampling, the two chats, the judgement buttons."""

    run_dir: Any
    checkpoint: Any
    refresh_btn: Any
    sampling: list  # max new tokens, temperature, top p, top k, seed
    left_chat: Any
    left_score: Any
    right_chat: Any
    right_score: Any
    message: Any
    send_btn: Any
    left_btn: Any
    tie_btn: Any
    right_btn: Any
    resample_btn: Any
    info: Any
    last: Any  # gr.State: the exchange waiting for a judgement
    known: Any  # gr.State: the checkpoints listed, to follow the run as it writes new ones
    timer: Any

    @property
    def judge_buttons(self) -> list:
        return [self.left_btn, self.tie_btn, self.right_btn, self.resample_btn]


def _sampling_controls() -> list:
    import gradio as gr

    with gr.Accordion("Sampling", open=False):
        with gr.Row():
            return [
                gr.Slider(1, 512, value=48, step=1, label="max new tokens", elem_id="eval-max-new"),
                gr.Slider(0.05, 2.0, value=0.8, step=0.05, label="temperature", elem_id="eval-temperature"),
                gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top p", elem_id="eval-top-p"),
                gr.Slider(0, 200, value=0, step=1, label="top k (0: off)", elem_id="eval-top-k"),
                gr.Number(0, precision=0, label="seed", elem_id="eval-seed"),
            ]


def _layout() -> EvalPanel:
    import gradio as gr

    with gr.Row():
        run_dir = gr.Textbox(label="Run directory", scale=3, elem_id="eval-run-dir")
        checkpoint = gr.Dropdown([], label="Checkpoint", allow_custom_value=True, scale=3, elem_id="eval-checkpoint")
        refresh_btn = gr.Button("Refresh checkpoints", elem_id="eval-refresh")
    sampling = _sampling_controls()
    with gr.Row():
        with gr.Column():
            left_chat = gr.Chatbot(label=LEFT_LABEL, height=320, elem_id="eval-left")
            left_score = gr.Markdown(elem_id="eval-left-score")
        with gr.Column():
            right_chat = gr.Chatbot(label=RIGHT_LABEL, height=320, elem_id="eval-right")
            right_score = gr.Markdown(elem_id="eval-right-score")
    with gr.Row():
        message = gr.Textbox(placeholder="Ask something…", show_label=False, scale=5, elem_id="eval-message")
        send_btn = gr.Button("Send", variant="primary", elem_id="eval-send")
    with gr.Row():  # off until there are two answers to judge
        left_btn = gr.Button("◀ Left better", interactive=False, elem_id="eval-left-better")
        tie_btn = gr.Button("Tie", interactive=False, elem_id="eval-tie")
        right_btn = gr.Button("Right better ▶", interactive=False, elem_id="eval-right-better")
        resample_btn = gr.Button("Resample (next seed)", interactive=False, elem_id="eval-resample")
    info = gr.Markdown(elem_id="eval-info")
    return EvalPanel(run_dir, checkpoint, refresh_btn, sampling, left_chat, left_score, right_chat, right_score,
                     message, send_btn, left_btn, tie_btn, right_btn, resample_btn, info, last=gr.State(None),
                     known=gr.State([]), timer=gr.Timer(FOLLOW_S))


FOLLOW_S = 2.0  # how often the checkpoint list follows the run


def button_states(pending) -> tuple:
    """Left / Tie / Right / Resample interactive or not: all off without answers; Left and Right off
    for two identical answers (no pair can come of them)."""
    import gradio as gr

    if not pending:
        return tuple(gr.update(interactive=False) for _ in range(4))
    different = pending["left"] != pending["right"]
    return (gr.update(interactive=different), gr.update(interactive=True), gr.update(interactive=different),
            gr.update(interactive=True))


def on_send(run_dir, ckpt, text, left_hist, right_hist, max_new, temperature, top_p, top_k, seed):
    """Both models answer ``text``: the chats, the scores, and the exchange to judge."""
    if not run_dir:
        raise UserError("give a run directory (or start/attach one in the Train tab)")
    if not ckpt:
        raise UserError("pick a checkpoint (Refresh checkpoints); a run writes one every checkpoint.every iterations")
    if not Path(ckpt).is_dir():
        raise UserError(f"checkpoint not found: {ckpt}")
    _verify(ckpt)
    sampling = chat.Sampling(int(max_new), float(temperature), float(top_p), int(top_k), int(seed or 0))
    models = chat.get_models(run_dir, ckpt)
    left, right = models.answer_both(text, sampling)
    user = {"role": "user", "content": text}
    left_hist = [*(left_hist or []), user, {"role": "assistant", "content": left.text or "(empty answer)"}]
    right_hist = [*(right_hist or []), user, {"role": "assistant", "content": right.text or "(empty answer)"}]
    pending = {"prompt": text, "left": left.text, "right": right.text, "left_score": left.score,
               "right_score": right.score, "checkpoint": str(ckpt), "run_dir": run_dir,
               "sampling": sampling.__dict__}
    info = "Which answer is better?" if left.text != right.text else identical_markdown(run_dir, sampling.seed)
    if "\ufffd" in left.text + right.text:
        info += (f" (An answer holds bytes that form no character, shown as \ufffd: at temperature "
                 f"{sampling.temperature:g} the model joined byte tokens that make no UTF-8 text.)")
    return (left_hist, right_hist, score_markdown(left), score_markdown(right), info, pending, "",
            *button_states(pending))


def _verify(ckpt: str) -> None:
    """Refuse a checkpoint whose actor adapter changed since it was written, before it loads."""
    from homerlhf.ppo.checkpoint import POLICY_FILES, verify_checkpoint

    verify_checkpoint(ckpt, POLICY_FILES, lambda fallback: f"pick {fallback.name} instead" if fallback
                      else "no earlier checkpoint's actor is intact")


def on_resample(pending, run_dir, ckpt, left_hist, right_hist, max_new, temperature, top_p, top_k, seed):
    """The last message again with the next seed: (send's outputs..., the new seed)."""
    if not pending:
        raise UserError("send a message first")
    seed = int(seed or 0) + 1
    out = on_send(run_dir, ckpt, pending["prompt"], left_hist, right_hist, max_new, temperature, top_p, top_k, seed)
    return (*out, seed)


def judge(choice: str):
    """The handler of one judgement button: record the pending exchange as ``choice``."""

    @guarded(6, error_index=0)
    def on_judge(pending):
        if not pending:
            raise UserError("send a message first; each answer pair can be judged once")
        if choice != "tie" and pending["left"] == pending["right"]:
            raise UserError("the two answers are identical: no preference pair can come of them; "
                            "press Resample for another seed, or record a Tie")
        path = preferences.record_preference(
            pending["run_dir"], pending["prompt"], pending["left"], pending["right"], choice,
            left_source="actor", right_source="reference",
            left_score=pending["left_score"], right_score=pending["right_score"],
            extra={"checkpoint": pending["checkpoint"], "sampling": pending["sampling"]},
        )
        return (f"Recorded **{choice}** in `{path}`. " + counts_markdown(pending["run_dir"]), None,
                *button_states(None))

    return on_judge


def follow_checkpoints(run_dir: str, current: str, known: list) -> tuple:
    """The checkpoint list as the run writes new ones: (dropdown update, known). A new newest one is
    selected (the newest usable one) unless the user picked an older one; nothing changes while the
    list is the same."""
    import gradio as gr

    choices = checkpoint_choices(run_dir)
    paths = [path for _, path in choices]
    if paths == list(known or []):
        return gr.update(), known
    follow = not current or not known or current == known[0] or current not in paths
    return gr.update(choices=choices, value=default_checkpoint(choices) if follow else current), paths


def _wire_checkpoints(panel: EvalPanel, run_dir_shared) -> None:
    """The run dir follows the Train tab's; the checkpoint list follows the run dir and its new checkpoints."""
    import gradio as gr

    def sync_run(shared):
        choices = checkpoint_choices(shared)
        return shared, gr.update(choices=choices, value=default_checkpoint(choices)), [p for _, p in choices]

    run_dir_shared.change(sync_run, run_dir_shared, [panel.run_dir, panel.checkpoint, panel.known])

    def on_refresh(run_dir):
        choices = checkpoint_choices(run_dir)
        note = "" if choices else "No checkpoint in this run yet (the trainer saves one every `checkpoint.every` iterations and when stopped)."
        return gr.update(choices=choices, value=default_checkpoint(choices)), note, [p for _, p in choices]

    panel.refresh_btn.click(on_refresh, panel.run_dir, [panel.checkpoint, panel.info, panel.known])
    panel.run_dir.submit(on_refresh, panel.run_dir, [panel.checkpoint, panel.info, panel.known])
    panel.timer.tick(follow_checkpoints, [panel.run_dir, panel.checkpoint, panel.known],
                     [panel.checkpoint, panel.known], show_progress="hidden")


def build(run_dir_shared) -> None:
    import gradio as gr

    gr.Markdown("### Evaluate\nThe same prompt, sampling settings and seed go to the trained actor (left) and "
                "the reference — the base with the adapter off (right). Pick the better answer to add a "
                "preference record for `homerlhf reward` (ties go to a separate file). Loading a checkpoint "
                "takes a second copy of the base in memory: on a full GPU, evaluate after the run stops.")
    panel = _layout()
    _wire_checkpoints(panel, run_dir_shared)
    send = guarded(11, error_index=4)(on_send)
    send_outputs = [panel.left_chat, panel.right_chat, panel.left_score, panel.right_score, panel.info, panel.last,
                    panel.message, *panel.judge_buttons]
    send_inputs = [panel.run_dir, panel.checkpoint, panel.message, panel.left_chat, panel.right_chat, *panel.sampling]
    panel.send_btn.click(send, send_inputs, send_outputs)
    panel.message.submit(send, send_inputs, send_outputs)
    seed = panel.sampling[-1]
    panel.resample_btn.click(guarded(12, error_index=4)(on_resample), [panel.last, *send_inputs[:2], *send_inputs[3:]],
                             [*send_outputs, seed])
    for button, choice in ((panel.left_btn, "left"), (panel.right_btn, "right"), (panel.tie_btn, "tie")):
        button.click(judge(choice), panel.last, [panel.info, panel.last, *panel.judge_buttons])
