"""GGUF export, the llama.cpp worker server, its client and process lifecycle."""
