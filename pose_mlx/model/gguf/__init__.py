"""Read GGUF files of the llama family as mlx-lm models (the reader is being split into modules)."""

from .header import (Header, TensorInfo, build_tokenizer, config_from_gguf, convert, load_gguf, load_tokenizer,
                     mlx_name, read_header, tokenizer_config, unpermute_rows, write_tokenizer)

__all__ = ["Header", "TensorInfo", "build_tokenizer", "config_from_gguf", "convert", "load_gguf", "load_tokenizer",
           "mlx_name", "read_header", "tokenizer_config", "unpermute_rows", "write_tokenizer"]
