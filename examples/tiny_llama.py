"""Write a tiny Llama directory (config.json + model.safetensors) to try `hf:PATH` without a download.

    python examples/tiny_llama.py tiny-llama

Any local Hugging Face directory of the GPT-2 or Llama family works the same way (one downloaded
elsewhere with `huggingface-cli download`, or your own `save_pretrained`). This one has 4 decoder
layers of hidden 128, grouped-query attention, SwiGLU, RMSNorm, RoPE, untied head, 256 tokens (so
a text file is read as bytes when the directory has no tokenizer.json), and windows of 64 tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main(folder: str) -> None:
    config = LlamaConfig(
        vocab_size=256, max_position_embeddings=64, hidden_size=128, intermediate_size=344,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    print(f"wrote {folder}: a {sum(p.numel() for p in LlamaForCausalLM(config).parameters()):,}-parameter Llama")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write a tiny Llama directory to try `pipectl profile hf:PATH`.")
    parser.add_argument("folder", nargs="?", default="tiny-llama", help="a new folder to write (default: tiny-llama)")
    folder = parser.parse_args().folder
    if Path(folder).exists() and any(Path(folder).iterdir()):  # never write over someone's model
        parser.error(f"{folder}: already exists and is not empty; name a new folder")
    main(folder)
