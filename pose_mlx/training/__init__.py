"""The training side of a run: data streams (`data`), LoRA adapters (`lora`), the loop (`loop`), crash-safe
checkpoints (`checkpoint`), data parallelism (`distributed`) and the run's training stage (`stage`)."""
