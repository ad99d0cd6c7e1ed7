"""Launch the homerlhf Gradio app: `python app.py [--host 127.0.0.1] [--port 7860] [--share]`."""

from homerlhf.cli import main

if __name__ == "__main__":
    import sys

    main(["app", *sys.argv[1:]])
