"""Convert a GGUF file (llama.cpp, Ollama, LM Studio) to an mlx-lm model folder: `python -m pose_mlx.convert`.

    python -m pose_mlx.convert model.gguf OUT/ [--keep-quantized] [--overwrite]

OUT gets config.json, model.safetensors and the tokenizer (tokenizer.json, tokenizer_config.json with the
chat template), which `mlx_lm.load`, `python -m mlx_lm generate` and every pose_mlx command read. Supported:
the llama architecture (Llama, Mistral, SmolLM, ...) and qwen2, with F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import ArgumentParser, UserError, command
from .model.gguf import convert
from .places import check_output


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m pose_mlx.convert", description=__doc__.split("\n")[0])
    parser.add_argument("gguf", help="the .gguf file to convert")
    parser.add_argument("out", help="the model folder to write (must not exist unless --overwrite)")
    parser.add_argument("--keep-quantized", action="store_true",
                        help="keep Q8_0/Q4_0/Q4_1 weights quantized (MLX affine, group size 32; smaller, and fast "
                             "on Apple GPUs) instead of dequantizing every weight to float32 (exact; fastest on CPUs)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    return parser


@command("pose_mlx.convert")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_output("OUT", args.out)
    if Path(args.out).exists() and not args.overwrite:
        raise UserError(f"{args.out} already exists; pass --overwrite to replace it")

    folder = convert(args.gguf, args.out, keep_quantized=args.keep_quantized, overwrite=args.overwrite)
    files = sorted(p.name for p in folder.iterdir())
    kind = "quantized weights kept" if args.keep_quantized else "float32 weights"
    print(f"wrote {folder} ({kind}): {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
