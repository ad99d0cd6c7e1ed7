"""The Evaluate tab: chat with the trained actor and, beside it, the reference (the base with the adapter
off) or another checkpoint of the same base (after a feedback run, by default the one it started from),
see the reward model's score under each answer, and record which is better: the human feedback loop
closes here.

Each message is a fresh single-turn prompt for both models (so every judgement is one
prompt/chosen/rejected record): the windows show that one exchange, the newest, and say which
checkpoint answered; a new message or *Resample* replaces it, and following another run clears it.
Thumbs, drafts and *Train on my feedback* are :mod:`homerlhf.app.eval_feedback`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homerlhf.app import chat, feedback, feedback_runs, preferences, runs
from homerlhf.app.common import guarded
from homerlhf.errors import UserError

LEFT_LABEL = "Left: the checkpoint picked"
RIGHT_LABEL = "Right: what it is compared with"
BASE = "base"  # the right side's value for the base with the adapter off (the reference)
BASE_LABEL = "base, adapter off (reference)"
SINGLE_TURN = ("**One message at a time:** each message is answered alone, without the ones before it (the "
               "model sees no conversation), so the windows show the newest exchange only and name the "
               "checkpoint that answered.")


def checkpoint_choices(run_dir: str) -> list[tuple[str, str]]:
    """(label, path) of the run's checkpoints, newest first; one whose actor adapter is not what its
    manifest recorded is marked with why (Send refuses it). A DPO / KTO run's list ends with the
    checkpoint it started from, so the same prompt can be asked of both."""
    from homerlhf.ppo.checkpoint import POLICY_FILES

    states = runs.checkpoint_states(run_dir, POLICY_FILES) if run_dir else []
    choices = [(runs.checkpoint_label(p.name, problem), str(p)) for p, problem in states]
    start = feedback_runs.start_checkpoint(run_dir) if run_dir else None
    if start is not None and start.is_dir():
        choices.append((f"{start.name} of {feedback.owner_run(start).name} (where this run started)", str(start)))
    return choices


def right_choices(run_dir: str) -> list[tuple[str, str]]:
    """What the right side can answer with: the base (adapter off), or any checkpoint listed on the left."""
    return [(BASE_LABEL, BASE), *checkpoint_choices(run_dir)]


def default_right(run_dir: str) -> str:
    """A feedback run's right side is the checkpoint it started from (what the feedback changed); else the base."""
    start = feedback_runs.start_checkpoint(run_dir) if run_dir else None
    return str(start) if start is not None and start.is_dir() else BASE


def right_update(run_dir: str, current: str = ""):
    """The right side's list for ``run_dir``: ``current`` kept while listed, else :func:`default_right`."""
    import gradio as gr

    choices = right_choices(run_dir)
    keep = current and current in [value for _, value in choices]
    return gr.update(choices=choices, value=current if keep else default_right(run_dir))


def default_checkpoint(choices: list[tuple[str, str]]):
    """The newest checkpoint of the run not marked unusable (else the first listed; None for none)."""
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
    from homerlhf.app.monitor_notes import NEGATIVE_KL

    kl = round(rows[-1]["kl_mean"], 4) + 0.0  # + 0.0: -0.0 reads as 0.0000
    note = f" ({NEGATIVE_KL})" if kl < 0 else ""
    return (f"KL to the reference so far: {kl:.4f} nats per response at iteration "
            f"{rows[-1].get('iteration', len(rows))}{note}")


def identical_markdown(run_dir: str, seed: int, right_is_base: bool = True) -> str:
    kl = kl_so_far(run_dir) if right_is_base else ""
    moved = ("the trained actor still samples what the reference does, so the policy has not moved here"
             if right_is_base else "the two checkpoints sample the same answer, so training has not changed it here")
    return (f"**The two answers are identical** (seed {seed}): on this prompt {moved}" + (f" ({kl})" if kl else "") + ". "
            "Identical answers make no preference pair, so *Left/Right better* are off: press *Resample* for "
            "another seed, or record a *Tie*.")


@dataclass
class EvalPanel:
    """The tab's components: run and checkpoint, sampling, the two chats, the judgement buttons."""

    run_dir: Any
    checkpoint: Any
    right: Any  # Dropdown: what answers on the right: the base (adapter off) or a checkpoint of the same base
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
    last: Any  # gr.State: the exchange on screen (judged once; rated and drafted until the next)
    known: Any  # gr.State: the checkpoints listed, to follow the run as it writes new ones
    timer: Any

    @property
    def judge_buttons(self) -> list:
        return [self.left_btn, self.tie_btn, self.right_btn, self.resample_btn]

    @property
    def exchange(self) -> list:
        """What shows one exchange: the chats, their scores, the info line and the exchange itself."""
        return [self.left_chat, self.right_chat, self.left_score, self.right_score, self.info, self.last]


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
        run_dir = gr.Textbox(label="Run directory", scale=2, elem_id="eval-run-dir")
        checkpoint = gr.Dropdown([], label="Left: checkpoint", allow_custom_value=True, scale=3, elem_id="eval-checkpoint")
        right = gr.Dropdown([(BASE_LABEL, BASE)], value=BASE, label="Right: compare with", scale=4, elem_id="eval-right-side")
        refresh_btn = gr.Button("Refresh checkpoints", elem_id="eval-refresh")
    sampling = _sampling_controls()
    gr.Markdown(SINGLE_TURN, elem_id="eval-single-turn")
    with gr.Row():
        with gr.Column():
            left_chat = gr.Chatbot(label=LEFT_LABEL, height=320, elem_id="eval-left")
            left_score = gr.Markdown(elem_id="eval-left-score")
        with gr.Column():
            right_chat = gr.Chatbot(label=RIGHT_LABEL, height=320, elem_id="eval-right")
            right_score = gr.Markdown(elem_id="eval-right-score")
    with gr.Row():
        message = gr.Textbox(placeholder="Ask something (answered alone, as a new conversation)…", show_label=False,
                             scale=5, elem_id="eval-message")
        send_btn = gr.Button("Send", variant="primary", elem_id="eval-send")
    with gr.Row():  # off until there are two answers to judge
        left_btn = gr.Button("◀ Left better", interactive=False, elem_id="eval-left-better")
        tie_btn = gr.Button("Tie", interactive=False, elem_id="eval-tie")
        right_btn = gr.Button("Right better ▶", interactive=False, elem_id="eval-right-better")
        resample_btn = gr.Button("Resample (next seed)", interactive=False, elem_id="eval-resample")
    info = gr.Markdown(elem_id="eval-info")
    return EvalPanel(run_dir, checkpoint, right, refresh_btn, sampling, left_chat, left_score, right_chat, right_score,
                     message, send_btn, left_btn, tie_btn, right_btn, resample_btn, info, last=gr.State(None),
                     known=gr.State([]), timer=gr.Timer(FOLLOW_S))


FOLLOW_S = 2.0  # how often the checkpoint list follows the run


def button_states(pending) -> tuple:
    """Left / Tie / Right / Resample interactive or not: all off without answers; Left and Right off
    for two identical answers (no pair can come of them); Left, Tie and Right off once judged."""
    import gradio as gr

    if not pending:
        return tuple(gr.update(interactive=False) for _ in range(4))
    open_ = not pending.get("judged")
    different = open_ and pending["left"] != pending["right"]
    return (gr.update(interactive=different), gr.update(interactive=open_), gr.update(interactive=different),
            gr.update(interactive=True))


def cleared(note: str = "") -> tuple:
    """``exchange`` outputs with nothing on screen (another run followed), and the judgement buttons off."""
    import gradio as gr

    return (gr.update(value=[], label=LEFT_LABEL), gr.update(value=[], label=RIGHT_LABEL), "", "", note, None,
            *button_states(None))


def side_name(ckpt: str) -> str:
    """Who answers in a window: ``iter_000001 of RUN``, or the base model with the adapter off."""
    return BASE_LABEL if not ckpt or ckpt == BASE else f"{Path(ckpt).name} of {feedback.owner_run(ckpt).name}"


def _chat(text: str, answer: str, side: str, ckpt: str):
    import gradio as gr

    return gr.update(value=[{"role": "user", "content": text}, {"role": "assistant", "content": answer or "(empty answer)"}],
                     label=f"{side}: {side_name(ckpt)}")


def on_send(run_dir, ckpt, right, text, left_hist, right_hist, max_new, temperature, top_p, top_k, seed):
    """Both sides answer ``text`` alone: the chats (this exchange only, replacing the one before), the
    scores, the info line and the exchange to judge. The checkpoint may be of another run than
    ``run_dir`` (the one a DPO / KTO run started from): it is loaded, and its feedback kept, with its own run.
    ``right``: :data:`BASE` (the reference) or a checkpoint of the same base."""
    if not run_dir:
        raise UserError("give a run directory (or start/attach one in the Train tab)")
    if not ckpt:
        raise UserError("pick a checkpoint (Refresh checkpoints); a run writes one every checkpoint.every iterations")
    if not Path(ckpt).is_dir():
        raise UserError(f"checkpoint not found: {ckpt}")
    _verify(ckpt)
    other = "" if not right or right == BASE else str(right)
    if other:
        if not Path(other).is_dir():
            raise UserError(f"checkpoint not found: {other}; pick another in 'Right: compare with'")
        _verify(other)
    owner = str(feedback.owner_run(ckpt))
    sampling = chat.Sampling(int(max_new), float(temperature), float(top_p), int(top_k), int(seed or 0))
    left, right_answer = chat.get_models(owner, ckpt, other or None).answer_both(text, sampling)
    answers = [{"text": a.text, "source": source, "score": a.score, "seed": sampling.seed}
               for a, source in ((left, "actor"), (right_answer, "compared" if other else "reference"))]
    pending = {"prompt": text, "left": left.text, "right": right_answer.text, "left_score": left.score,
               "right_score": right_answer.score, "checkpoint": str(ckpt), "right_checkpoint": other, "run_dir": owner,
               "sampling": sampling.__dict__, "answers": answers, "rated": [], "pairs": []}
    info = "Which answer is better?" if left.text != right_answer.text else \
        identical_markdown(owner, sampling.seed, right_is_base=not other)
    if "\ufffd" in left.text + right_answer.text:
        info += (f" (An answer holds bytes that form no character, shown as \ufffd: at temperature "
                 f"{sampling.temperature:g} the model joined byte tokens that make no UTF-8 text.)")
    return (_chat(text, left.text, "Left", ckpt), _chat(text, right_answer.text, "Right", other), score_markdown(left),
            score_markdown(right_answer), info, pending, text, *button_states(pending))


def _verify(ckpt: str) -> None:
    """Refuse a checkpoint whose actor adapter changed since it was written, before it loads."""
    from homerlhf.ppo.checkpoint import POLICY_FILES, verify_checkpoint

    verify_checkpoint(ckpt, POLICY_FILES, lambda fallback: f"pick {fallback.name} instead" if fallback
                      else "no earlier checkpoint's actor is intact")


def on_resample(pending, run_dir, ckpt, right, left_hist, right_hist, max_new, temperature, top_p, top_k, seed):
    """The last message again with the next seed, replacing its answers: (send's outputs..., the new seed)."""
    if not pending:
        raise UserError("send a message first")
    seed = int(seed or 0) + 1
    out = on_send(run_dir, ckpt, right, pending["prompt"], left_hist, right_hist, max_new, temperature, top_p, top_k, seed)
    return (*out, seed)


def judge(choice: str):
    """The handler of one judgement button: record the exchange on screen as ``choice`` (once)."""

    @guarded(6, error_index=0)
    def on_judge(pending):
        if not pending or pending.get("judged"):
            raise UserError("send a message first; each answer pair can be judged once")
        if choice != "tie" and pending["left"] == pending["right"]:
            raise UserError("the two answers are identical: no preference pair can come of them; "
                            "press Resample for another seed, or record a Tie")
        path = preferences.record_preference(
            pending["run_dir"], pending["prompt"], pending["left"], pending["right"], choice,
            left_source="actor", right_source=pending["answers"][1]["source"] if "answers" in pending else "reference",
            left_score=pending["left_score"], right_score=pending["right_score"],
            extra={"checkpoint": pending["checkpoint"], "sampling": pending["sampling"]},
        )
        done = dict(pending, judged=True)
        if choice != "tie":
            won, lost = (pending["left"], pending["right"])[::1 if choice == "left" else -1]
            done["pairs"] = [*pending.get("pairs", []), [won, lost]]
        return (f"Recorded **{choice}** in `{path}`. " + counts_markdown(pending["run_dir"]), done,
                *button_states(done))

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


def follow_both(run_dir: str, current: str, right: str, known: list) -> tuple:
    """:func:`follow_checkpoints`, and the right side's list with it: (left update, right update, known)."""
    import gradio as gr

    update, paths = follow_checkpoints(run_dir, current, known)
    return update, (gr.update() if paths is known else right_update(run_dir, right)), paths


def no_checkpoint_note(run_dir: str) -> str:
    """Why the list is empty: no such directory, a directory that holds no run, or a run without a checkpoint yet."""
    if not (run_dir or "").strip():
        return "No run directory: type one, or Start or Attach a run in the Train tab."
    if not Path(run_dir).is_dir():
        return f"No run directory at `{run_dir}`: check the path, or Start or Attach a run in the Train tab."
    if not runs.is_run_dir(Path(run_dir)):
        return f"`{run_dir}` holds no run (no metrics.jsonl, checkpoints or config): give a run's directory."
    return ("No checkpoint in this run yet: the trainer saves one every `checkpoint.every` iterations and when "
            "stopped; the list fills in by itself.")


def _wire_checkpoints(panel: EvalPanel, run_dir_shared) -> None:
    """The run dir follows the Train tab's; the checkpoint lists follow the run dir and its new checkpoints.
    Another run followed clears the exchange on screen (its answers were another policy's)."""
    import gradio as gr

    def sync_run(shared, shown):
        choices = checkpoint_choices(shared)
        clear = cleared() if shared != shown else (gr.update(),) * 10
        return (shared, gr.update(choices=choices, value=default_checkpoint(choices)), right_update(shared),
                [p for _, p in choices], *clear)

    run_dir_shared.change(sync_run, [run_dir_shared, panel.run_dir], [panel.run_dir, panel.checkpoint, panel.right,
                                                                       panel.known, *panel.exchange, *panel.judge_buttons])

    def on_refresh(run_dir, right, pending):
        choices = checkpoint_choices(run_dir)
        note = "" if choices else no_checkpoint_note(run_dir)
        other = pending and Path(pending["checkpoint"]) not in [Path(p) for _, p in choices]
        clear = cleared(note) if other else (*(gr.update(),) * 4, note, *(gr.update(),) * 5)
        return (gr.update(choices=choices, value=default_checkpoint(choices)), right_update(run_dir, right),
                [p for _, p in choices], *clear)

    outputs = [panel.checkpoint, panel.right, panel.known, *panel.exchange, *panel.judge_buttons]
    panel.refresh_btn.click(on_refresh, [panel.run_dir, panel.right, panel.last], outputs)
    panel.run_dir.submit(on_refresh, [panel.run_dir, panel.right, panel.last], outputs)
    panel.timer.tick(follow_both, [panel.run_dir, panel.checkpoint, panel.right, panel.known],
                     [panel.checkpoint, panel.right, panel.known], show_progress="hidden")


def build(run_dir_shared, settings=None, runs_root: str = "runs") -> None:
    """Lay out the tab; ``settings``: the Plan tab's (a feedback run trains with its preset and overrides)."""
    import gradio as gr

    from homerlhf.app import eval_feedback

    gr.Markdown("### Evaluate\nThe same prompt, sampling settings and seed go to the checkpoint picked (left) and "
                "what it is compared with (right): the base with the adapter off (the reference), or another "
                "checkpoint — after *Train on my feedback*, the one it started from. Pick the better answer, rate "
                "one, ask for another draft, or write the answer you would prefer; *Train on my feedback* trains "
                "the left policy on what you gave (DPO or KTO). Loading a checkpoint takes a second copy of the "
                "base in memory: on a full GPU, evaluate after the run stops.")
    panel = _layout()
    _wire_checkpoints(panel, run_dir_shared)
    send = guarded(11, error_index=4)(on_send)
    send_outputs = [*panel.exchange[:5], panel.last, panel.message, *panel.judge_buttons]
    send_inputs = [panel.run_dir, panel.checkpoint, panel.right, panel.message, panel.left_chat, panel.right_chat,
                   *panel.sampling]
    fb = eval_feedback.build(panel, run_dir_shared, settings, runs_root)
    for event in (panel.send_btn.click, panel.message.submit):
        event(send, send_inputs, send_outputs).then(*fb.after_exchange)
    seed = panel.sampling[-1]
    panel.resample_btn.click(guarded(12, error_index=4)(on_resample), [panel.last, *send_inputs[:3], *send_inputs[4:]],
                             [*send_outputs, seed]).then(*fb.after_exchange)
    for button, choice in ((panel.left_btn, "left"), (panel.right_btn, "right"), (panel.tie_btn, "tie")):
        button.click(judge(choice), panel.last, [panel.info, panel.last, *panel.judge_buttons]).then(*fb.after_record)
