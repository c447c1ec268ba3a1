"""Convert between GGUF files (llama.cpp, Ollama, LM Studio) and mlx-lm model folders: `python -m pose_mlx.convert`.

    python -m pose_mlx.convert model.gguf OUT/ [--keep-quantized] [--overwrite]     # GGUF -> folder
    python -m pose_mlx.convert FOLDER/ OUT.gguf [--outtype f16] [--overwrite]       # folder -> GGUF

The direction follows the first argument: a GGUF file becomes a folder with config.json, model.safetensors and
the tokenizer (tokenizer.json, tokenizer_config.json with the chat template), which `mlx_lm.load`, `python -m
mlx_lm generate` and every pose_mlx command read; a model folder (an extended one from `pose_mlx.finetune`
included) becomes a GGUF file that llama.cpp runs with the extended window: its context length, its RoPE schedule
as llama.cpp's keys (none/ntk/abf as a new base, linear, YaRN, Llama 3), its tokenizer. Supported: the llama
architecture (Llama, Mistral, SmolLM, ...) and qwen2; GGUF files with F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import ArgumentParser, UserError, command
from .places import check_output

#: --outtype's default: llama.cpp's converter's (half the size of float32, the precision of most checkpoints).
DEFAULT_OUTTYPE = "f16"


def build_parser() -> ArgumentParser:
    from .model.gguf.write import OUTTYPES

    parser = ArgumentParser(prog="python -m pose_mlx.convert", description=__doc__.split("\n")[0])
    parser.add_argument("source", metavar="SOURCE", help="a .gguf file (to a folder) or a model folder (to GGUF)")
    parser.add_argument("out", metavar="OUT",
                        help="the model folder or .gguf file to write (must not exist unless --overwrite)")
    parser.add_argument("--keep-quantized", action="store_true",
                        help="GGUF -> folder: keep Q8_0/Q4_0/Q4_1 weights quantized (MLX affine, group size 32; "
                             "smaller, and fast on Apple GPUs) instead of dequantizing every weight to float32 "
                             "(exact; fastest on CPUs)")
    parser.add_argument("--outtype", choices=OUTTYPES, default=None,
                        help=f"folder -> GGUF: the type of the weight matrices, {', '.join(OUTTYPES)} (default "
                             f"{DEFAULT_OUTTYPE}; norms stay f32; q8_0 is llama.cpp's 8-bit blocks, about half of "
                             "f16's size)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    return parser


@command("pose_mlx.convert")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    source = Path(args.source).expanduser()
    if not source.exists():
        raise UserError(f"{args.source}: no such file or folder")
    check_output("OUT", args.out, folder=source.is_file())
    if Path(args.out).exists() and not args.overwrite:
        raise UserError(f"{args.out} already exists; pass --overwrite to replace it")
    if source.is_dir():
        return _to_gguf(args, source)
    if args.outtype is not None:
        raise UserError("--outtype is for writing a GGUF file (SOURCE a model folder); SOURCE is a file")
    from .model.gguf import convert

    folder = convert(source, args.out, keep_quantized=args.keep_quantized, overwrite=args.overwrite)
    files = sorted(p.name for p in folder.iterdir())
    kind = "quantized weights kept" if args.keep_quantized else "float32 weights"
    print(f"wrote {folder} ({kind}): {', '.join(files)}")
    return 0


def _to_gguf(args, folder: Path) -> int:
    from .model.gguf.write import export_gguf

    if args.keep_quantized:
        raise UserError("--keep-quantized is for reading a GGUF file; SOURCE is a folder (use --outtype q8_0 for "
                        "a quantized GGUF file)")
    if Path(args.out).is_dir():
        raise UserError(f"OUT {args.out} is a folder; name the .gguf file to write")
    info = export_gguf(folder, args.out, args.outtype or DEFAULT_OUTTYPE, overwrite=args.overwrite)
    rope = ", ".join(f"{k.split('.', 1)[1]}={v:g}" if isinstance(v, float) else f"{k.split('.', 1)[1]}={v}"
                     for k, v in info["rope"].items())
    print(f"wrote {info['path']} ({info['architecture']}, {info['outtype']}; {rope}; tokenizer from "
          f"{info['tokenizer']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
