"""Training the draft head: self-distillation data (`distill`), distillation training with the backbone
frozen (`train`), learning curves (`curve`), and the prompts reserved for evaluation (`reserved`).

Uses decoding and the shared modules; decoding does not use it.
"""
