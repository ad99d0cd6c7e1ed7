"""Gradio UI pieces; app.py at the top of the repo only launches it."""
