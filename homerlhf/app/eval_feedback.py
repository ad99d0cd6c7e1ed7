"""The Evaluate tab's feedback row: thumbs up / down on one answer, another draft to pick from, the best
of the answers on screen, the count of what was collected for the policy, and *Train on my feedback*
(records: :mod:`homerlhf.app.feedback`; the run: :mod:`homerlhf.app.feedback_runs`).

The answers of an exchange are numbered: 1 the actor's (left), 2 the right side's (the reference, or the
checkpoint compared), 3 and on the actor's further drafts (each with the next seed, shown under the
actor's answer) and the answers a person wrote (*Your answer*: saved as the chosen side of a pair against
the picked model answer, its ``chosen_source`` ``human``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from homerlhf.app import chat, feedback, feedback_runs, preferences
from homerlhf.app.common import guarded
from homerlhf.errors import UserError

HUMAN = "human"  # the source of an answer a person wrote: the origin the pairs file records
WHERE = {"actor": "left, actor", "reference": "right, reference", "compared": "right, compared checkpoint",
         HUMAN: "your answer"}


def pick_choices(pending) -> list[tuple[str, int]]:
    """(label, index) of each answer on screen: '1 · left, actor (seed 0)', ..., '3 · draft, actor (seed 1)',
    '4 · your answer'."""
    answers = (pending or {}).get("answers", [])
    where = lambda i, a: WHERE[a["source"]] if i < 2 or a["source"] == HUMAN else "draft, actor"  # noqa: E731
    return [(f"{i + 1} · {where(i, a)}" + (f" (seed {a['seed']})" if a.get("seed") is not None else ""), i)
            for i, a in enumerate(answers)]


def after_exchange(pending, checkpoint) -> tuple:
    """A new exchange on screen: the answers to pick from (none picked), the count line, *Your answer* emptied."""
    import gradio as gr

    return gr.update(choices=pick_choices(pending), value=None), feedback.counts_markdown(checkpoint), ""


def _picked(pending, pick) -> tuple[int, dict]:
    if not pending:
        raise UserError("send a message first")
    if pick is None or not 0 <= int(pick) < len(pending["answers"]):
        raise UserError("pick an answer first (1 = left, 2 = right, 3 and on = drafts)")
    return int(pick), pending["answers"][int(pick)]


def _extra(pending, answer: dict) -> dict:
    if answer.get("seed") is None:  # written by a person: no sampling made it
        return {"checkpoint": pending["checkpoint"]}
    return {"checkpoint": pending["checkpoint"], "sampling": dict(pending["sampling"], seed=answer["seed"])}


def on_edit(pending, pick) -> str:
    """*Edit the picked answer*: its text into *Your answer* (answer 1 when none is picked)."""
    if not pending:
        raise UserError("send a message first")
    index = int(pick) if pick is not None and 0 <= int(pick) < len(pending["answers"]) else 0
    return pending["answers"][index]["text"]


def on_write(pending, pick, text, left_chat) -> tuple:
    """*Save mine as better*: the answer typed in *Your answer* recorded as preferred to the picked model answer
    (answer 1, the left one, when none is picked) — one pair, ``chosen_source`` ``human`` — and added to the
    answers on screen. Returns (message, pending, picks, count, left chat)."""
    import gradio as gr

    if not pending:
        raise UserError("send a message first: your answer is saved as better than an answer of the model to it")
    text = (text or "").strip()
    if not text:
        raise UserError("write your answer in 'Your answer' first ('Edit the picked answer' copies one there)")
    index = int(pick) if pick is not None and 0 <= int(pick) < len(pending["answers"]) else 0
    against = pending["answers"][index]
    if against["source"] == HUMAN:
        raise UserError("pick an answer of the model to prefer yours to (1 = left, 2 = right, 3 and on = drafts)")
    if against["text"].strip() == text:
        raise UserError(f"your answer is answer {index + 1} as it is: change it first, or rate that answer (Thumbs up)")
    if [text, against["text"]] in pending.get("pairs", []):
        raise UserError(f"already saved as better than answer {index + 1}; pick another answer, or change yours")
    path = preferences.record_preference(pending["run_dir"], pending["prompt"], text, against["text"], "left",
                                         left_source=HUMAN, right_source=against["source"],
                                         right_score=against.get("score"), extra={"checkpoint": pending["checkpoint"]})
    mine = {"text": text, "source": HUMAN, "score": None, "seed": None}
    done = dict(pending, answers=[*pending["answers"], mine], pairs=[*pending.get("pairs", []), [text, against["text"]]])
    n = len(done["answers"])
    bubble = {"role": "assistant", "content": f"*Your answer* (answer {n}, better than answer {index + 1}): {text}"}
    return (f"Saved your answer (answer {n}) as better than answer {index + 1}: a pair in `{path}`, marked "
            f"`chosen_source: {HUMAN}`.", done, gr.update(choices=pick_choices(done)),
            feedback.counts_markdown(pending["checkpoint"]), [*(left_chat or []), bubble])


def rate(good: bool):
    """The handler of Thumbs up (``good``) or down: one rated answer. Returns (message, pending, count)."""

    @guarded(3, error_index=0)
    def on_rate(pending, pick):
        index, answer = _picked(pending, pick)
        if index in pending["rated"]:
            raise UserError(f"answer {index + 1} is already rated; pick another, or send a new message")
        path = feedback.record_rating(pending["run_dir"], pending["prompt"], answer["text"], good, answer["source"],
                                      answer.get("score"), _extra(pending, answer))
        done = dict(pending, rated=[*pending["rated"], index])
        return (f"Recorded thumbs **{'up' if good else 'down'}** for answer {index + 1} in `{path}`.",
                done, feedback.counts_markdown(pending["checkpoint"]))

    return on_rate


def on_draft(pending, left_chat, max_new, temperature, top_p, top_k) -> tuple:
    """The actor once more on the same message with the next seed: (left chat, pending, picks, message)."""
    import gradio as gr

    if not pending:
        raise UserError("send a message first")
    seed = max(a["seed"] for a in pending["answers"] if a["source"] == "actor" and a.get("seed") is not None) + 1
    sampling = chat.Sampling(int(max_new), float(temperature), float(top_p), int(top_k), seed)
    models = chat.get_models(pending["run_dir"], pending["checkpoint"], pending.get("right_checkpoint") or None)
    answer = models.answer_actor(pending["prompt"], sampling)
    drafted = {"text": answer.text, "source": "actor", "score": answer.score, "seed": seed}
    done = dict(pending, answers=[*pending["answers"], drafted])
    n = len(done["answers"])
    score = "n/a" if answer.score is None else f"{answer.score:+.4f}"
    bubble = {"role": "assistant", "content": f"*Draft {n}* (seed {seed}, reward score {score}): {answer.text or '(empty answer)'}"}
    same = [str(i + 1) for i, a in enumerate(pending["answers"]) if a["text"] == answer.text]
    note = f" It is the same text as answer {', '.join(same)}." if same else ""
    return ([*(left_chat or []), bubble], done, gr.update(choices=pick_choices(done)),
            f"Draft {n} sampled (seed {seed}).{note} Pick the best answer and press *Best of these*, or rate one.")


def on_best(pending, pick) -> tuple:
    """The picked answer preferred to every other one on screen: (message, pending, count)."""
    index, answer = _picked(pending, pick)
    done_pairs = frozenset(tuple(p) for p in pending.get("pairs", []))
    written = feedback.record_best(pending["run_dir"], pending["prompt"], pending["answers"], index,
                                   _extra(pending, answer), done_pairs)
    if not written:
        raise UserError(f"no new pair: every other answer is the same text as answer {index + 1}, or already "
                        "recorded against it; ask for another draft")
    done = dict(pending, pairs=[*pending.get("pairs", []), *[list(p) for p in written]])
    return (f"Recorded answer {index + 1} as better than {len(written)} other answer(s): {len(written)} pair(s) in "
            f"`{Path(pending['run_dir']) / preferences.PAIRS_FILE}`.", done,
            feedback.counts_markdown(pending["checkpoint"]))


def on_train(checkpoint, method, preset, model, overrides, preset_model, run_dir, runs_root: str) -> tuple:
    """Start the DPO / KTO run on the feedback: (message, the shared run dir: the new run)."""
    from homerlhf.app.plan_tab import run_overrides

    items = run_overrides(model, overrides, preset_model)
    watch = [runs_root, *([Path(run_dir).parent] if run_dir else [])]
    started = feedback_runs.start_feedback_run(checkpoint, method, preset, items, watch)
    return started.message, str(started.run_dir)


def follow_result(run_dir, shown) -> tuple:
    """The finished feedback run's figures when they appear: (result box, shown, message box: the lines of
    its start, e.g. a second start refused, end with it)."""
    import gradio as gr

    from homerlhf.app.feedback_result import result_markdown

    text = result_markdown(run_dir) if run_dir else ""
    if text == shown:
        return gr.update(), shown, gr.update()
    return text, text, "" if text else gr.update()


@dataclass
class FeedbackPanel:
    pick: Any
    count: Any
    message: Any
    result: Any
    after_exchange: tuple  # (handler, inputs, outputs) to chain after a send or resample
    after_record: tuple  # likewise after a judgement: the count line


def _layout():
    import gradio as gr

    with gr.Row():
        pick = gr.Radio([], label="Answer to rate or pick (1 = left, 2 = right, 3 and on = drafts)", scale=3,
                        elem_id="eval-pick")
        up_btn = gr.Button("Thumbs up", elem_id="eval-thumbs-up")
        down_btn = gr.Button("Thumbs down", elem_id="eval-thumbs-down")
        draft_btn = gr.Button("Another draft", elem_id="eval-draft")
        best_btn = gr.Button("Best of these", elem_id="eval-best")
    with gr.Row():
        yours = gr.Textbox(label="Your answer: write the one you would prefer (or edit the picked one); it is saved as "
                                 "better than the picked answer (1, the left one, when none is picked)", lines=3,
                           scale=4, elem_id="eval-your-answer")
        with gr.Column(scale=1, min_width=200):
            edit_btn = gr.Button("Edit the picked answer", elem_id="eval-edit")
            write_btn = gr.Button("Save mine as better", elem_id="eval-save-mine")
    count = gr.Markdown(feedback.counts_markdown(None), elem_id="eval-feedback-count")
    with gr.Row():
        method = gr.Radio(list(feedback_runs.METHODS), value="auto", elem_id="eval-feedback-method", scale=3,
                          label="Train on: auto (DPO when the pairs suffice, else KTO), dpo (pairs), kto (ratings and pairs)")
        train_btn = gr.Button("Train on my feedback", variant="primary", elem_id="eval-train-feedback")
    message = gr.Markdown(elem_id="eval-feedback-message")
    result = gr.Markdown(elem_id="eval-feedback-result")
    return pick, up_btn, down_btn, draft_btn, best_btn, count, method, train_btn, message, result, (yours, edit_btn,
                                                                                                    write_btn)


def build(panel, run_dir_shared, settings=None, runs_root: str = "runs") -> FeedbackPanel:
    """Lay out and wire the row under ``panel`` (the Evaluate tab's :class:`EvalPanel`)."""
    import gradio as gr

    pick, up_btn, down_btn, draft_btn, best_btn, count, method, train_btn, message, result, mine = _layout()
    last = panel.last
    yours, edit_btn, write_btn = mine
    edit_btn.click(guarded(2, error_index=1)(lambda pending, picked: (on_edit(pending, picked), "")), [last, pick],
                   [yours, message])
    write_btn.click(guarded(5, error_index=0)(on_write), [last, pick, yours, panel.left_chat],
                    [message, last, pick, count, panel.left_chat])
    up_btn.click(rate(True), [last, pick], [message, last, count])
    down_btn.click(rate(False), [last, pick], [message, last, count])
    draft_btn.click(guarded(4, error_index=3)(on_draft), [last, panel.left_chat, *panel.sampling[:4]],
                    [panel.left_chat, last, pick, message])
    best_btn.click(guarded(3, error_index=0)(on_best), [last, pick], [message, last, count])
    panel.checkpoint.change(feedback.counts_markdown, panel.checkpoint, count)
    plan = _plan_inputs(settings)

    @guarded(2, error_index=0)
    def train(ckpt, how, preset, model, overrides, preset_model, run_dir):
        return on_train(ckpt, how, preset, model, overrides, preset_model, run_dir, runs_root)

    train_btn.click(train, [panel.checkpoint, method, *plan, panel.run_dir], [message, run_dir_shared])
    shown = gr.State("")
    panel.timer.tick(follow_result, [panel.run_dir, shown], [result, shown, message], show_progress="hidden")
    return FeedbackPanel(pick, count, message, result,
                         after_exchange=(after_exchange, [last, panel.checkpoint], [pick, count, yours]),
                         after_record=(feedback.counts_markdown, panel.checkpoint, count))


def _plan_inputs(settings: Optional[Any]) -> list:
    """The Plan tab's preset, model, overrides and the preset's model (a feedback run trains with them)."""
    import gradio as gr

    if settings is None:  # the tab alone (tests): the embedded default preset, no overrides
        return [gr.State("cpu-tiny"), gr.State(""), gr.State(""), gr.State("")]
    return [settings.preset, settings.model, settings.overrides, settings.preset_model]
