"""A simulator run's folder and the stages every run built on the simulator's base shares: the corpus, the
pre-trained base (copied from `--pretrained` when it was made alike), its gates, and the fine-tuning data of each
example length. `python -m pose_mlx.sim` (the grid) and `python -m pose_mlx.sim.map` (the factor map) both start
here, so a map run on the default settings has the grid's corpus, base and gates.
"""

from __future__ import annotations

import json
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from . import SHIPPED_BASE
from . import corpus as corpus_mod
from . import finetune_data, gates
from .config import SimConfig
from .pretrain import made_with, pretrain, reuse_base
from .stages import Stages
from ..errors import Stopped, UserError
from ..files import replace_dir
from ..training.loop import Interrupted


@dataclass
class Workspace:
    """One simulator run: its settings, its folders under --out, its stages, and the earlier run's results that
    --reuse-results takes instead of running them again (`prior`)."""

    config: SimConfig
    out: Path
    stages: Stages
    prior: dict = field(default_factory=dict)

    @property
    def data(self) -> Path:
        """The corpus: tokenizer/, train/, val/, test/ and corpus.json."""
        return self.out / "corpus"

    @property
    def cache(self) -> Path:
        return self.out / "cache"

    @property
    def model(self) -> Path:
        """The pre-trained base."""
        return self.out / "pretrained"

    def take(self, stage: str) -> None:
        """Stage `stage`'s output taken from --reuse-results, with the time the earlier run recorded for it."""
        self.stages.reuse(stage, self.prior.get("stage_seconds", {}).get(stage), self.config.reuse_results)


def build_corpus(config: SimConfig, out: Path, created: bool) -> None:
    """The corpus built aside and moved into place: a refused corpus leaves nothing behind (nor --out, when this
    run `created` it)."""
    building, data = out / ".corpus.tmp", out / "corpus"
    shutil.rmtree(building, ignore_errors=True)
    try:
        corpus_mod.build_corpus(building, config.corpus, config.corpus_chars, config.test_docs,
                                config.test_tokens, config.val_fraction, config.vocab, config.seed,
                                corpus_mod.resolve_prose(config.prose, config.corpus))
    except BaseException as error:
        shutil.rmtree(building, ignore_errors=True)
        if created:  # this run made --out, and nothing is in it yet
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(error, ValueError):  # --corpus empty, too few or too short documents
            raise UserError(error) from None
        raise
    replace_dir(building, data)  # over a corpus without corpus.json: left by a killed run


def _pretrain(ws: Workspace, made: dict) -> None:
    """The pre-training stage; a signal stops it after a checkpoint, which the rerun resumes."""
    c, data = ws.config, ws.data
    try:
        pretrain(ws.model, data / "tokenizer", data / "train", data / "val", ws.cache,
                 retrieval_fraction=c.retrieval_fraction, window=c.window, base=c.base, hidden=c.hidden,
                 layers=c.layers, heads=c.heads, ffn=c.ffn, steps=c.pretrain_steps, batch=c.pretrain_batch,
                 lr=c.pretrain_lr, seed=c.seed, made=made)
    except Interrupted as stop:
        raise Stopped(stop.signum, f"pre-training stopped by {signal.Signals(stop.signum).name}; checkpoint "
                                   f"saved at step {stop.step}; rerun the same command to resume") from None


def _use_pretrained(pretrained: str, model: Path, made: dict) -> None:
    """--pretrained: copy the base it names to `model` when it was `made` alike, so the pre-training stage is
    cached; a folder that does not match is the user's error, the shipped base that does not is skipped."""
    source = SHIPPED_BASE if pretrained == "shipped" else Path(pretrained)
    why_not = reuse_base(source, model, made, name="shipped" if pretrained == "shipped" else None)
    if why_not is None:
        print(f"pretrain: the base in {source} was made with these settings on this corpus; using it", flush=True)
    elif pretrained == "shipped":
        print(f"pretrain: not using the shipped base ({why_not})", flush=True)
    else:
        raise UserError(f"--pretrained {source}: {why_not}")


def base_model(ws: Workspace) -> None:
    """The base at `ws.model`: --pretrained's copy when it was made alike, else pre-trained here."""
    made = made_with(ws.config.to_dict(), ws.data)
    if not (ws.model / "pretrain.json").is_file() and ws.config.pretrained != "none":
        _use_pretrained(ws.config.pretrained, ws.model, made)
    ws.stages.run("pretrain", lambda: (ws.model / "pretrain.json").is_file(), lambda: _pretrain(ws, made))


def _measure_gates(ws: Workspace, path: Path) -> None:
    c = ws.config
    record = gates.measure(ws.model, ws.data / "train", ws.data / "test", ws.cache, c.window, c.target, c.seed,
                           ws.out / "eval" / "base.passkey-gate.json")
    path.write_text(json.dumps(record, indent=1) + "\n")


def base_gates(ws: Workspace) -> dict:
    """The base's gates (`pose_mlx.sim.gates`), measured once into gates.json."""
    path = ws.out / "gates.json"
    ws.stages.run("gates", path.is_file, lambda: _measure_gates(ws, path))
    return json.loads(path.read_text())


def start(config: SimConfig, weights: dict[str, float]) -> tuple[Workspace, dict]:
    """--out made (nothing else before the settings were checked), then the corpus, base and gates stages, with a
    progress line per stage of `weights` (stage_seconds.json keeps each one's time); returns (workspace, gates)."""
    out = Path(config.out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    ws = Workspace(config, out, Stages(weights, record=out / "stage_seconds.json"))
    ws.stages.run("corpus", lambda: (ws.data / "corpus.json").is_file(), lambda: build_corpus(config, out, created))
    base_model(ws)
    return ws, base_gates(ws)


def finetune_folder(ws: Workspace, length: int) -> Path:
    """The stage 'finetune data <length>': the training split plus retrieval documents of `length` tokens
    (`pose_mlx.sim.finetune_data`, the share --finetune-retrieval); returns its folder."""
    c = ws.config
    folder = ws.out / "finetune-data" / str(length)
    ws.stages.run(f"finetune data {length}", lambda: (folder / finetune_data.RETRIEVAL_FILE).is_file(),
                  lambda: finetune_data.build(folder, ws.data / "train", load_tokenizer(ws.model), ws.cache,
                                              length, c.finetune_retrieval, c.seed))
    return folder


__all__ = ["Workspace", "base_gates", "base_model", "build_corpus", "finetune_folder", "start"]
