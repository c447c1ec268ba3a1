"""Read GGUF files (llama.cpp, Ollama, LM Studio) of the llama family as mlx-lm models, and write model folders
back as GGUF files llama.cpp runs.

- `header`: `read_header(path) -> Header`: parse and validate everything but the tensor data (no MLX); the file
  layout is described there.
- `config`: `config_from_gguf(path_or_header)`: the Hugging Face style config.json dict mlx-lm reads (metadata
  only).
- `weights`: the tensors as mlx-lm parameters (`mlx_name`, `unpermute_rows`; block types and llama.cpp's Q/K row
  order are described there).
- `tokenizer`: `build_tokenizer` / `tokenizer_config` / `write_tokenizer(path_or_header, folder)` /
  `load_tokenizer`: the file's tokenizer as a `tokenizers.Tokenizer`, tokenizer.json + tokenizer_config.json, an
  mlx-lm `TokenizerWrapper`.
- `load`: `load_gguf(path, keep_quantized=None)`: (mlx-lm model, mlx-lm TokenizerWrapper, config);
  `convert(path, out_folder, keep_quantized=False)`: a model folder `mlx_lm.load` reads.
- `write`: `export_gguf(folder, out, outtype)`: the reverse, written with gguf-py, over `rope_keys` (a schedule as
  the keys llama.cpp reads, and what llama.cpp computes from them) and `vocab_out` (the tokenizer's keys).

Every problem with a file is a `pose_mlx.errors.UserError` naming the file: the header is checked against
the file size before anything is allocated, so a truncated or forged file fails with one line.
"""

from .config import config_from_gguf
from .header import Header, TensorInfo, read_header
from .load import convert, load_gguf
from .tokenizer import build_tokenizer, load_tokenizer, tokenizer_config, write_tokenizer
from .weights import mlx_name, permute_rows, unpermute_rows
from .write import export_gguf

__all__ = ["Header", "TensorInfo", "build_tokenizer", "config_from_gguf", "convert", "export_gguf", "load_gguf",
           "load_tokenizer", "mlx_name", "permute_rows", "read_header", "tokenizer_config", "unpermute_rows",
           "write_tokenizer"]
