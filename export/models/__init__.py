"""The PyTorch reference models, one module per model whose layers are its own: gpt2.py (GPT-2), llama.py (the
Llama model and its parts, which Gemma 3, SmolLM3, Granite and Phi-3 turn on by config), gemma4.py, and the
hybrids lfm2.py and qwen35.py; reference.py is what their forwards share. A family module (export/families/)
loads a checkpoint into one of them and turns it into a Decoder (export/decoder.py).
"""
