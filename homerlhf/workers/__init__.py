"""GGUF export, the llama.cpp worker (:mod:`.engine` computes, :mod:`.server` serves it over HTTP),
its client and process lifecycle."""
